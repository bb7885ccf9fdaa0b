"""`lmstack serve`: the OpenAI API over the engine (routes in app.py, request and answer shapes in protocol.py).

    service = Service("smollm2", api_key=None)
    app = create_app(service)          # an ASGI app; /health answers 503 until service.load(model, tokenizer)
    serve(load, service, host="127.0.0.1", port=8000)   # uvicorn until Ctrl-C or SIGTERM
"""

import gc
import logging
import signal
import threading
import time

from .app import Service, create_app

__all__ = ["Service", "create_app", "serve"]

log = logging.getLogger("lmstack.server")


def serve(load, service: Service, *, host: str = "127.0.0.1", port: int = 8000, engine_options=None):
    """Serve on host:port until Ctrl-C or SIGTERM, answering (/health: 503) while the model loads.

    `load()` -> (model, tokenizer) runs in this (the main) thread while uvicorn serves from another; then this
    thread only waits, and the engine's computes alone (Engine.start lets go of this thread's OpenMP workers).
    What the load made lives until exit, so it is frozen out of the garbage collector: a full collection of its
    objects took 60 ms for SmolLM2, holding the GIL, which the engine's thread needs between operators. On
    Ctrl-C or SIGTERM the engine closes first, so every request in flight ends at once (streams with an error
    event), then uvicorn stops; during the load they stop the process as usual.
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(service), host=host, port=port, access_log=False,
                                           lifespan="off", timeout_graceful_shutdown=5, log_level="warning"))
    http = threading.Thread(target=server.run, name="lmstack-http", daemon=True)  # signals stay ours
    http.start()
    while not server.started:
        if not http.is_alive():
            raise OSError(f"could not serve on {host}:{port} (see the error above)")
        time.sleep(0.01)
    log.info("loading %r; http://%s:%d/health answers 503 until it is ready", service.name, host, port)
    try:
        service.load(*load(), **(engine_options or {}))
        gc.freeze()
        log.info("serving %r on http://%s:%d/v1", service.name, host, port)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        log.info("stopping: requests in flight end with an error")
    finally:
        service.close()
        server.should_exit = True
        http.join()
