// One transformer block's step in one call (blocks/transformer.py: TransformerBlock.fused): RMSNorm, the qkv
// projection, rotary with the cache write, attention, the output projection and residual, RMSNorm, gate_up,
// silu(gate) * up, down and residual. It calls the operators the block's Python code calls, in the same order,
// so the numbers are the same; what it saves is the dozen Python calls between them, a third of a small
// model's decode step.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>

namespace {

using Tensor = at::Tensor;
using Optional = std::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// A projection as its formats.py module computes a few rows: the kernel (kind), its weights, the bias added
// inside the kernel (bias) or after it, as a separate addition (bias_after).
struct Projection {
  std::string kind;
  Tensor weight;
  Optional scales, bias, bias_after;
  int64_t n = 0, qtype = 0;

  Tensor operator()(const Tensor& x) const {
    static const auto bf16_tiled = find<Tensor(const Tensor&, const Tensor&, int64_t, const Optional&)>(
        "lmstack::matvec_bf16_tiled");
    static const auto bf16 = find<Tensor(const Tensor&, const Tensor&, const Optional&)>("lmstack::matvec_bf16");
    static const auto f32 = find<Tensor(const Tensor&, const Tensor&, const Optional&)>("lmstack::matvec_f32");
    static const auto int8 =
        find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Optional&)>("lmstack::matvec_int8");
    static const auto gguf =
        find<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Optional&)>("lmstack::gguf_matvec");
    Tensor y;
    if (kind == "bf16_tiled")
      y = bf16_tiled.call(x, weight, n, bias);
    else if (kind == "bf16")
      y = bf16.call(x, weight, bias);
    else if (kind == "f32")
      y = f32.call(x, weight, bias);
    else if (kind == "int8")
      y = int8.call(x, weight, *scales, bias);
    else if (kind == "gguf")
      y = gguf.call(x, weight, qtype, n, bias);
    else if (kind == "int4") {  // Int4Linear's matmul
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
      shape.back() = -1;
      y = at::_weight_int4pack_mm_for_cpu(x.reshape({-1, x.size(-1)}), weight, 32, *scales).view(shape);
    } else
      TORCH_CHECK(false, "fused layer: no projection of kind '", kind, "'");
    return bias_after.has_value() ? y + *bias_after : y;
  }
};

struct Layer : torch::CustomClassHolder {
  Tensor attn_norm, mlp_norm;
  Optional q_norm, k_norm;
  double eps;
  int64_t heads, kv_heads, head_dim, window;
  std::string act;  // MLP's activation (blocks/transformer.py: ACTIVATIONS)
  Projection qkv, o, gate_up, down;

  Layer(Tensor attn_norm, Tensor mlp_norm, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
        int64_t window, std::string act)
      : attn_norm(attn_norm), mlp_norm(mlp_norm), eps(eps), heads(heads), kv_heads(kv_heads), head_dim(head_dim),
        window(window), act(std::move(act)) {
    TORCH_CHECK(this->act == "silu" || this->act == "gelu" || this->act == "gelu_pytorch_tanh" || this->act == "relu",
                "fused layer: no activation '", this->act, "'");
  }

  void set_projection(const std::string& name, const std::string& kind, Tensor weight, Optional scales,
                      int64_t n, int64_t qtype, Optional bias, Optional bias_after) {
    Projection p{kind, weight, scales, bias, bias_after, n, qtype};
    if (name == "qkv")
      qkv = p;
    else if (name == "o")
      o = p;
    else if (name == "gate_up")
      gate_up = p;
    else {
      TORCH_CHECK(name == "down", "fused layer: no projection '", name, "'");
      down = p;
    }
  }

  void set_qk_norms(Tensor q, Tensor k) { q_norm = q, k_norm = k; }

  Tensor norm(const Tensor& x, const Tensor& weight) const {
    static const auto rms_norm = find<Tensor(const Tensor&, const Tensor&, double)>("lmstack::rms_norm");
    return rms_norm.call(x, weight, eps);
  }

  // x (B, L, d) -> the q, k and v heads (B, L, H + 2 KV, D), q and k normalized where the family does
  Tensor heads_of(const Tensor& x) const {
    Tensor h = qkv(norm(x, attn_norm)).view({x.size(0), x.size(1), heads + 2 * kv_heads, head_dim});
    if (!q_norm.has_value()) return h;
    return at::cat({norm(h.slice(2, 0, heads), *q_norm), norm(h.slice(2, heads, heads + kv_heads), *k_norm),
                    h.slice(2, heads + kv_heads)},
                   2);
  }

  // act(gate) * up for gate_up = [gate | up], as MLP.forward computes it
  Tensor activated(const Tensor& gate_up) const {
    static const auto silu_mul = find<Tensor(const Tensor&)>("lmstack::silu_mul");
    if (act == "silu") return silu_mul.call(gate_up);
    const auto halves = gate_up.chunk(2, -1);
    const Tensor& gate = halves[0];
    return (act == "relu" ? at::relu(gate) : at::gelu(gate, act == "gelu" ? "none" : "tanh")) * halves[1];
  }

  // x + attention output, then the MLP and its residual
  Tensor finish(const Tensor& x, const Tensor& attended) const {
    const Tensor h = x + o(attended);
    return h + down(activated(gate_up(norm(h, mlp_norm))));
  }

  // One new token per row (B, 1, d) into contiguous caches (B, KV, T, D) at slot `start`, no mask.
  Tensor decode(Tensor x, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache, int64_t start) {
    static const auto rope = find<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, int64_t)>(
        "lmstack::rope_into_cache");
    static const auto attention =
        find<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t)>("lmstack::decode_attention");
    const Tensor q = rope.call(heads_of(x), cos, sin, k_cache, v_cache, start);
    return finish(x, attention.call(q, k_cache, v_cache, start + 1));
  }

  // Tokens of many sequences in one row (1, T, d), keys and values through block tables (PagedContext).
  Tensor paged(Tensor x, Tensor cos, Tensor sin, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor tables,
               Tensor seqs, Tensor positions) {
    static const auto rope =
        find<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)>(
            "lmstack::rope_into_pages");
    static const auto attention =
        find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                    int64_t)>("lmstack::paged_attention");
    const Tensor q = rope.call(heads_of(x), cos, sin, k_pool, v_pool, slots)[0];
    return finish(x, attention.call(q.contiguous(), k_pool, v_pool, tables, seqs, positions, window).unsqueeze(0));
  }
};

// Every block of a model, for a decode step in which none is masked or a paged step: one call from Python.
struct Stack : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<Layer>> layers;

  void add(c10::intrusive_ptr<Layer> layer) { layers.push_back(std::move(layer)); }

  Tensor decode(Tensor x, Tensor cos, Tensor sin, std::vector<Tensor> k_caches, std::vector<Tensor> v_caches,
                int64_t start) {
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(), "fused stack: ",
                layers.size(), " layers, ", k_caches.size(), " and ", v_caches.size(), " caches");
    for (size_t i = 0; i < layers.size(); i++) x = layers[i]->decode(x, cos, sin, k_caches[i], v_caches[i], start);
    return x;
  }

  Tensor paged(Tensor x, Tensor cos, Tensor sin, std::vector<Tensor> k_pools, std::vector<Tensor> v_pools,
               Tensor slots, Tensor tables, Tensor seqs, Tensor positions) {
    TORCH_CHECK(k_pools.size() == layers.size() && v_pools.size() == layers.size(), "fused stack: ",
                layers.size(), " layers, ", k_pools.size(), " and ", v_pools.size(), " pools");
    for (size_t i = 0; i < layers.size(); i++)
      x = layers[i]->paged(x, cos, sin, k_pools[i], v_pools[i], slots, tables, seqs, positions);
    return x;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.class_<Layer>("Layer")
      .def(torch::init<Tensor, Tensor, double, int64_t, int64_t, int64_t, int64_t, std::string>())
      .def("set_projection", &Layer::set_projection)
      .def("set_qk_norms", &Layer::set_qk_norms)
      .def("decode", &Layer::decode)
      .def("paged", &Layer::paged);
  m.class_<Stack>("Stack")
      .def(torch::init<>())
      .def("add", &Stack::add)
      .def("decode", &Stack::decode)
      .def("paged", &Stack::paged);
}
