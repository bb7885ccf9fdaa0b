// One transformer block's step in one call (blocks/transformer.py: TransformerBlock.fused): RMSNorm, the qkv
// projection, rotary with the cache write, attention, the output projection and residual, RMSNorm, gate_up,
// silu(gate) * up, down and residual. It calls the operators the block's Python code calls, in the same order,
// so the numbers are the same; what it saves is the dozen Python calls between them, a third of a small
// model's decode step. Options beyond Llama's (set_*): Gemma's norms (scaled in float32 by 1 + weight, rounded
// once), its sandwich norms, the scale of the attention scores, a sliding layer's own rotary tables; and the MLP
// as a mixture of experts (MixtureOfExperts.forward's operators: only the chosen experts' weights are read).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <set>
#include <string>

namespace {

using Tensor = at::Tensor;
using Optional = std::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// A projection as its formats.py module computes a few rows: the kernel (kind), its weights, the bias added
// inside the kernel (bias) or after it, as a separate addition (bias_after); or parts of several kinds ("cat").
struct Projection {
  std::string kind;
  Tensor weight;
  Optional scales, bias, bias_after;
  int64_t n = 0, qtype = 0;
  std::vector<Projection> parts;  // kind "cat": each part's output, concatenated

  Tensor operator()(const Tensor& x) const {
    static const auto bf16_tiled = find<Tensor(const Tensor&, const Tensor&, int64_t, const Optional&)>(
        "lmstack::matvec_bf16_tiled");
    static const auto bf16 = find<Tensor(const Tensor&, const Tensor&, const Optional&)>("lmstack::matvec_bf16");
    static const auto f32 = find<Tensor(const Tensor&, const Tensor&, const Optional&)>("lmstack::matvec_f32");
    static const auto f32_tiled = find<Tensor(const Tensor&, const Tensor&, int64_t, const Optional&)>(
        "lmstack::matvec_f32_tiled");
    static const auto int8 =
        find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Optional&)>("lmstack::matvec_int8");
    static const auto gguf =
        find<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Optional&)>("lmstack::gguf_matvec");
    Tensor y;
    if (kind == "cat") {
      std::vector<Tensor> ys;
      for (const auto& part : parts) ys.push_back(part(x));
      y = at::cat(ys, -1);
    } else if (kind == "bf16_tiled")
      y = bf16_tiled.call(x, weight, n, bias);
    else if (kind == "bf16")
      y = bf16.call(x, weight, bias);
    else if (kind == "f32")
      y = f32.call(x, weight, bias);
    else if (kind == "f32_tiled")
      y = f32_tiled.call(x, weight, n, bias);
    else if (kind == "linear")  // F.linear: a router whose weights are not of x's dtype
      y = at::linear(x, weight, bias);
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
  Optional q_norm, k_norm, post_attn_norm, post_mlp_norm;
  bool float32_norms = false;  // every norm scales in float32 by its float32 weight, rounded once (RMSNorm's offset)
  double scale = 0.0;          // of the attention scores; 0: 1/sqrt(head_dim)
  bool local_rope = false;     // rotates by the stack's local tables where it is given them (a sliding layer)
  double eps;
  int64_t heads, kv_heads, head_dim, window;
  std::string act;  // MLP's activation (blocks/transformer.py: ACTIVATIONS)
  Projection qkv, o, gate_up, down;
  Projection router;  // a mixture's, where top_k > 0: then gate_up and down are unused
  std::vector<Projection> expert_gate_up, expert_down;
  int64_t top_k = 0;
  bool norm_topk_prob = false, float32_weights = false;

  Layer(Tensor attn_norm, Tensor mlp_norm, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
        int64_t window, std::string act)
      : attn_norm(attn_norm), mlp_norm(mlp_norm), eps(eps), heads(heads), kv_heads(kv_heads), head_dim(head_dim),
        window(window), act(std::move(act)) {
    TORCH_CHECK(this->act == "silu" || this->act == "gelu" || this->act == "gelu_pytorch_tanh" || this->act == "relu",
                "fused layer: no activation '", this->act, "'");
  }

  // the projection `name` ("expert_gate_up" and "expert_down": `next`, a new expert's; else the last one's)
  Projection& slot(const std::string& name, bool next) {
    if (name == "expert_gate_up" || name == "expert_down") {
      auto& experts = name == "expert_gate_up" ? expert_gate_up : expert_down;
      if (next) experts.emplace_back();
      TORCH_CHECK(!experts.empty(), "fused layer: no expert to add a part to");
      return experts.back();
    }
    if (name == "qkv") return qkv;
    if (name == "o") return o;
    if (name == "gate_up") return gate_up;
    if (name == "router") return router;
    TORCH_CHECK(name == "down", "fused layer: no projection '", name, "'");
    return down;
  }

  void set_projection(const std::string& name, const std::string& kind, Optional weight, Optional scales,
                      int64_t n, int64_t qtype, Optional bias, Optional bias_after) {
    TORCH_CHECK(weight.has_value() || kind == "cat", "fused layer: projection '", name, "' has no weight");
    slot(name, true) = Projection{kind, weight.value_or(Tensor()), scales, bias, bias_after, n, qtype};
  }

  // a part of the projection `name` last set with kind "cat" (GGUFLinear's parts: their outputs concatenated)
  void add_part(const std::string& name, const std::string& kind, Tensor weight, Optional scales, int64_t n,
                int64_t qtype, Optional bias, Optional bias_after) {
    Projection& whole = slot(name, false);
    TORCH_CHECK(whole.kind == "cat", "fused layer: projection '", name, "' is not of kind 'cat'");
    whole.parts.push_back(Projection{kind, weight, scales, bias, bias_after, n, qtype});
  }

  void set_qk_norms(Tensor q, Tensor k) { q_norm = q, k_norm = k; }

  // Gemma's: a norm on the attention's and on the MLP's output, before each residual add
  void set_post_norms(Tensor attn, Tensor mlp) { post_attn_norm = attn, post_mlp_norm = mlp; }

  // every norm's weight is float32 (1 + w for Gemma's), multiplied in float32, the product rounded once
  void set_float32_norms(bool on) { float32_norms = on; }

  void set_attention(double scale_, bool local_rope_) { scale = scale_, local_rope = local_rope_; }

  // the MLP as a mixture of the experts given by set_projection (router, expert_gate_up, expert_down)
  void set_experts(int64_t top_k_, bool norm_topk_prob_, bool float32_weights_) {
    TORCH_CHECK(top_k_ > 0 && top_k_ <= int64_t(expert_gate_up.size()) &&
                    expert_gate_up.size() == expert_down.size(),
                "fused layer: top ", top_k_, " of ", expert_gate_up.size(), " experts (", expert_down.size(),
                " down projections)");
    top_k = top_k_, norm_topk_prob = norm_topk_prob_, float32_weights = float32_weights_;
  }

  Tensor norm(const Tensor& x, const Tensor& weight) const {
    static const auto rms_norm = find<Tensor(const Tensor&, const Tensor&, double)>("lmstack::rms_norm");
    if (float32_norms)  // RMSNorm.forward with an offset
      return (at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps) * weight).to(x.scalar_type());
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

  // MixtureOfExperts.forward: the softmax of the router's scores, the top_k experts of each row (their weights
  // renormalized where norm_topk_prob), each chosen expert run on the rows that chose it, in expert order
  Tensor mixture(const Tensor& x_) const {
    const Tensor x = x_.reshape({-1, x_.size(-1)});
    const Tensor probs = router(x).to(at::kFloat).softmax(-1);
    auto [weights, chosen] = probs.topk(top_k, -1);
    if (norm_topk_prob) weights = weights / weights.sum(-1, true);
    if (!float32_weights) weights = weights.to(x.scalar_type());
    Tensor out = at::zeros_like(x);
    const Tensor ids = chosen.contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    if (x.size(0) == 1) {  // a decode step's one row: index_add_ of row 0 is an add, without its indexing
      std::vector<std::pair<int64_t, int64_t>> order;  // (expert, its place k in the row's top_k)
      for (int64_t k = 0; k < top_k; k++) order.emplace_back(id[k], k);
      std::sort(order.begin(), order.end());
      for (const auto& [e, k] : order)
        out.add_((expert_down[e](activated(expert_gate_up[e](x))) * weights.narrow(1, k, 1)).to(x.scalar_type()));
      return out.view(x_.sizes());
    }
    for (const int64_t e : std::set<int64_t>(id, id + ids.numel())) {
      const Tensor where = (chosen == e).nonzero();
      const Tensor rows = where.select(1, 0).contiguous(), k = where.select(1, 1).contiguous();
      const Tensor y = expert_down[e](activated(expert_gate_up[e](x.index({rows})))) *
                       weights.index({rows, k}).unsqueeze(-1);
      out.index_add_(0, rows, y.to(x.scalar_type()));
    }
    return out.view(x_.sizes());
  }

  // x + attention output, then the MLP and its residual
  Tensor finish(const Tensor& x, const Tensor& attended) const {
    const Tensor y = o(attended);
    const Tensor h = x + (post_attn_norm.has_value() ? norm(y, *post_attn_norm) : y);
    const Tensor normed = norm(h, mlp_norm);
    const Tensor z = top_k > 0 ? mixture(normed) : down(activated(gate_up(normed)));
    return h + (post_mlp_norm.has_value() ? norm(z, *post_mlp_norm) : z);
  }

  // One new token per row (B, 1, d) into contiguous caches (B, KV, T, D) at slot `start`, no mask.
  Tensor decode(Tensor x, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache, int64_t start) {
    static const auto rope = find<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, int64_t)>(
        "lmstack::rope_into_cache");
    static const auto attention =
        find<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, double)>("lmstack::decode_attention");
    const Tensor q = rope.call(heads_of(x), cos, sin, k_cache, v_cache, start);
    return finish(x, attention.call(q, k_cache, v_cache, start + 1, scale));
  }

  // Tokens of many sequences in one row (1, T, d), keys and values through block tables (PagedContext).
  Tensor paged(Tensor x, Tensor cos, Tensor sin, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor tables,
               Tensor seqs, Tensor positions) {
    static const auto rope =
        find<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)>(
            "lmstack::rope_into_pages");
    static const auto attention =
        find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                    int64_t, double)>("lmstack::paged_attention");
    const Tensor q = rope.call(heads_of(x), cos, sin, k_pool, v_pool, slots)[0];
    return finish(x,
                  attention.call(q.contiguous(), k_pool, v_pool, tables, seqs, positions, window, scale).unsqueeze(0));
  }
};

// Every block of a model, for a decode step in which none is masked or a paged step: one call from Python.
// local_cos, local_sin: the sliding layers' own rotary tables (AttentionContext.local), where the model has them.
struct Stack : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<Layer>> layers;

  void add(c10::intrusive_ptr<Layer> layer) { layers.push_back(std::move(layer)); }

  Tensor decode(Tensor x, Tensor cos, Tensor sin, std::vector<Tensor> k_caches, std::vector<Tensor> v_caches,
                int64_t start, Optional local_cos, Optional local_sin) {
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(), "fused stack: ",
                layers.size(), " layers, ", k_caches.size(), " and ", v_caches.size(), " caches");
    for (size_t i = 0; i < layers.size(); i++) {
      const bool local = layers[i]->local_rope && local_cos.has_value();
      x = layers[i]->decode(x, local ? *local_cos : cos, local ? *local_sin : sin, k_caches[i], v_caches[i], start);
    }
    return x;
  }

  Tensor paged(Tensor x, Tensor cos, Tensor sin, std::vector<Tensor> k_pools, std::vector<Tensor> v_pools,
               Tensor slots, Tensor tables, Tensor seqs, Tensor positions, Optional local_cos, Optional local_sin) {
    TORCH_CHECK(k_pools.size() == layers.size() && v_pools.size() == layers.size(), "fused stack: ",
                layers.size(), " layers, ", k_pools.size(), " and ", v_pools.size(), " pools");
    for (size_t i = 0; i < layers.size(); i++) {
      const bool local = layers[i]->local_rope && local_cos.has_value();
      x = layers[i]->paged(x, local ? *local_cos : cos, local ? *local_sin : sin, k_pools[i], v_pools[i], slots,
                           tables, seqs, positions);
    }
    return x;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack, m) {
  m.class_<Layer>("Layer")
      .def(torch::init<Tensor, Tensor, double, int64_t, int64_t, int64_t, int64_t, std::string>())
      .def("set_projection", &Layer::set_projection)
      .def("add_part", &Layer::add_part)
      .def("set_qk_norms", &Layer::set_qk_norms)
      .def("set_post_norms", &Layer::set_post_norms)
      .def("set_float32_norms", &Layer::set_float32_norms)
      .def("set_attention", &Layer::set_attention)
      .def("set_experts", &Layer::set_experts)
      .def("decode", &Layer::decode)
      .def("paged", &Layer::paged);
  m.class_<Stack>("Stack")
      .def(torch::init<>())
      .def("add", &Stack::add)
      .def("decode", &Stack::decode)
      .def("paged", &Stack::paged);
}
