"""`lmstack serve`: the OpenAI API over the engine (routes in app.py, request and answer shapes in protocol.py).

    service = Service("smollm2", api_key=None)
    app = create_app(service)          # an ASGI app; /health answers 503 until service.load(model, tokenizer)
    serve(load, service, host="127.0.0.1", port=8000)   # uvicorn until Ctrl-C or SIGTERM
"""

import logging
import threading

from .app import Service, create_app

__all__ = ["Service", "create_app", "serve"]

log = logging.getLogger("lmstack.server")


def serve(load, service: Service, *, host: str = "127.0.0.1", port: int = 8000, engine_options=None):
    """Serve on host:port until Ctrl-C or SIGTERM, loading the model meanwhile.

    `load()` -> (model, tokenizer) runs in a thread while the server already answers (/health: 503), so a
    supervisor sees it up. On Ctrl-C or SIGTERM the engine closes first, so every request in flight ends at
    once (streams with an error event), then uvicorn stops. A failed load stops the server and is raised.
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            service.close()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(create_app(service), host=host, port=port, access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=5, log_level="warning"))
    failure = []

    def loading():
        try:
            service.load(*load(), **(engine_options or {}))
            log.info("serving %r on http://%s:%d/v1", service.name, host, port)
        except BaseException as e:  # noqa: BLE001 -- raised again in the main thread
            failure.append(e)
            server.should_exit = True

    threading.Thread(target=loading, name="lmstack-load", daemon=True).start()
    log.info("loading %r; http://%s:%d/health answers 503 until it is ready", service.name, host, port)
    try:
        server.run()
    finally:
        service.close()
    if failure:
        raise failure[0]
