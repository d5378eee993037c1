"""Tiny bf16 CPU mixture-of-experts blocks in every spelling the compiler recognises,
re-creations of real model libraries' expert blocks, and negative cases.

Each model's ``inputs(seed)`` returns its forward arguments; routing changes with the
seed while shapes stay fixed. Sizes: G = 4 experts, H = F = 32 (or 64), T = 64 rows.
The real-model re-creations follow the structure of the upstream code (Hugging Face
transformers' ``integrations/moe.py`` grouped_mm experts, Qwen3-MoE / Mixtral /
GPT-OSS / Llama4 expert blocks, torchtitan's ``models/moe/moe.py``), written anew in
plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

G, H, FF, T, TOP_K = 4, 32, 32, 64, 2
BF16 = torch.bfloat16
TANH_S = 3.0


# ----------------------------------------------------------------------------- activations
# name -> (f(h), recognised activation, fc1 width multiplier)

def srelu_pow(h):
    return F.relu(h) ** 2


def srelu_square_method(h):
    return F.relu(h).square()


def srelu_torch_square(h):
    return torch.square(torch.relu(h))


def srelu_mul(h):
    return F.relu(h) * F.relu(h)


def tanh_srelu(h):
    return (TANH_S * torch.tanh(F.relu(h) / TANH_S)) ** 2


def swiglu_chunk(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_split(h):
    gate, up = h.split(h.shape[-1] // 2, dim=-1)
    return up * F.silu(gate)


def swiglu_slice(h):
    half = h.shape[-1] // 2
    return F.silu(h[..., :half]) * h[..., half:]


def swiglu_gate_second(h):
    up, gate = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu(h):
    return F.gelu(h)


ACTIVATIONS = {
    "srelu_pow": (srelu_pow, "srelu", 1),
    "srelu_square_method": (srelu_square_method, "srelu", 1),
    "srelu_torch_square": (srelu_torch_square, "srelu", 1),
    "srelu_mul": (srelu_mul, "srelu", 1),
    "tanh_srelu": (tanh_srelu, "tanh_srelu", 1),
    "swiglu_chunk": (swiglu_chunk, "swiglu", 2),
    "swiglu_split": (swiglu_split, "swiglu", 2),
    "swiglu_slice": (swiglu_slice, "swiglu", 2),
    "swiglu_gate_second": (swiglu_gate_second, "swiglu", 2),
}


def _param(*shape, dtype=BF16):
    return nn.Parameter(torch.randn(*shape, dtype=torch.float32).mul(shape[-1] ** -0.5).to(dtype))


def _sizes(seed, groups=G, rows=T):
    """Random rows per expert summing to ``rows`` (some may be 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, groups, (rows,), generator=gen)
    return torch.bincount(ids, minlength=groups)


def _x(seed, *shape, dtype=BF16):
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _probs(seed, *shape, dtype=BF16):
    gen = torch.Generator().manual_seed(2000 + seed)
    return torch.rand(*shape, generator=gen).to(dtype)


def _apply_prob(value, probs, where, here):
    return value * probs.unsqueeze(-1) if probs is not None and where == here else value


# ----------------------------------------------------------------------------- spelling 2: grouped_mm


class GroupedMM(nn.Module):
    """``torch._grouped_mm`` / ``F.grouped_mm`` with offs written directly.
    prob: None, "act" (on the activation) or "out" (on the fc2 output);
    layout "out_in" stores (G, out, in) and transposes, "in_out" stores (G, in, out)."""

    def __init__(self, act="srelu_pow", prob=None, layout="out_in", functional=False, hidden=H, ffn=FF,
                 dtype=BF16):
        super().__init__()
        self.act, _, mult = ACTIVATIONS[act] if act in ACTIVATIONS else (globals()[act], None, 1)
        self.prob, self.layout, self.functional = prob, layout, functional
        out_in = layout == "out_in"
        self.w1 = _param(*((G, mult * ffn, hidden) if out_in else (G, hidden, mult * ffn)), dtype=dtype)
        self.w2 = _param(*((G, hidden, ffn) if out_in else (G, ffn, hidden)), dtype=dtype)
        self.hidden = hidden

    def _mm(self, a, w, offs):
        w = w.transpose(-2, -1) if self.layout == "out_in" else w
        return F.grouped_mm(a, w, offs=offs) if self.functional else torch._grouped_mm(a, w, offs=offs)

    def forward(self, x, offs, probs=None):
        d = _apply_prob(self.act(self._mm(x, self.w1, offs)), probs, self.prob, "act")
        return _apply_prob(self._mm(d, self.w2, offs), probs, self.prob, "out")

    def inputs(self, seed):
        offs = torch.cumsum(_sizes(seed), 0, dtype=torch.int32)
        probs = _probs(seed, T) if self.prob else None
        return (_x(seed, T, self.hidden), offs, probs)


# ----------------------------------------------------------------------------- spelling 3: expert loop


class ExpertLoop(nn.Module):
    """A Python loop over experts on ``torch.split`` / ``x.split`` pieces.
    weights: "stacked" (W[e] of (G, out, in) parameters, F.linear), "modulelist"
    (nn.Linear per expert), "matmul_t" (x @ W[e].T), "matmul" (x @ W[e], (G, in, out)).
    sizes: "list" (python ints) or "tolist" (counts.tolist(), capture_scalar_outputs)."""

    def __init__(self, act="srelu_pow", prob=None, weights="stacked", sizes="list", hidden=H, ffn=FF,
                 dtype=BF16, fc2_bias=False, fc2_experts=G):
        super().__init__()
        self.act, _, mult = ACTIVATIONS[act] if act in ACTIVATIONS else (globals()[act], None, 1)
        self.prob, self.weights, self.sizes, self.hidden = prob, weights, sizes, hidden
        if weights == "modulelist":
            self.fc1 = nn.ModuleList(nn.Linear(hidden, mult * ffn, bias=False, dtype=dtype) for _ in range(G))
            self.fc2 = nn.ModuleList(nn.Linear(ffn, hidden, bias=fc2_bias, dtype=dtype) for _ in range(G))
        elif weights == "matmul":
            self.w1, self.w2 = _param(G, hidden, mult * ffn, dtype=dtype), _param(fc2_experts, ffn, hidden, dtype=dtype)
        else:
            self.w1, self.w2 = _param(G, mult * ffn, hidden, dtype=dtype), _param(fc2_experts, hidden, ffn, dtype=dtype)

    def _linear(self, which, e, a):
        if self.weights == "modulelist":
            return getattr(self, which)[e](a)
        w = getattr(self, "w1" if which == "fc1" else "w2")[e]
        if self.weights == "stacked":
            return F.linear(a, w)
        return a @ w.T if self.weights == "matmul_t" else a @ w

    def forward(self, x, counts, probs=None):
        sizes = counts.tolist() if self.sizes == "tolist" else counts
        xs = torch.split(x, sizes) if self.weights != "matmul" else x.split(sizes)
        ps = probs.split(sizes) if probs is not None else [None] * G
        outs = []
        for e in range(G):
            d = self.act(self._linear("fc1", e, xs[e]))
            if self.prob == "act":
                d = d * ps[e][:, None]
            y = self._linear("fc2", e, d)
            if self.prob == "out":
                y = y * ps[e].unsqueeze(-1)
            outs.append(y)
        return torch.cat(outs, dim=0)

    def inputs(self, seed):
        sizes = _sizes(seed)
        counts = sizes if self.sizes == "tolist" else sizes.tolist()
        return (_x(seed, T, self.hidden, dtype=self.w_dtype), counts, _probs(seed, T) if self.prob else None)

    @property
    def w_dtype(self):
        return next(self.parameters()).dtype


# ----------------------------------------------------------------------------- spelling 4: bmm


class BMM(nn.Module):
    """``torch.bmm`` over a (G, T/G, H) expert batch, weights (G, in, out)."""

    def __init__(self, act="srelu_pow", prob=None, hidden=H, ffn=FF):
        super().__init__()
        self.act, _, mult = ACTIVATIONS[act] if act in ACTIVATIONS else (globals()[act], None, 1)
        self.prob, self.hidden = prob, hidden
        self.w1, self.w2 = _param(G, hidden, mult * ffn), _param(G, ffn, hidden)

    def forward(self, x, probs=None):
        d = _apply_prob(self.act(torch.bmm(x, self.w1)), probs, self.prob, "act")
        return _apply_prob(torch.bmm(d, self.w2), probs, self.prob, "out")

    def inputs(self, seed):
        return (_x(seed, G, T // G, self.hidden), _probs(seed, G, T // G) if self.prob else None)


# ----------------------------------------------------------------------------- spelling 1: token permutation


class Router(nn.Module):
    """Softmax top-k router: (T, H) -> (top_k probs (T, k), expert ids (T, k))."""

    def __init__(self, hidden=H, experts=G, top_k=TOP_K):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False, dtype=BF16)
        self.top_k = top_k

    def forward(self, x):
        scores = F.softmax(self.gate(x).float(), dim=-1)
        top, ids = torch.topk(scores, self.top_k, dim=-1)
        return (top / top.sum(-1, keepdim=True)).to(x.dtype), ids


class HFGroupedMMExperts(nn.Module):
    """Hugging Face transformers' ``grouped_mm_experts_forward`` (integrations/moe.py) on
    an experts module with ``gate_up_proj`` (G, 2F, H) and ``down_proj`` (G, H, F), as
    used by Qwen3-MoE / Mixtral / DeepSeek experts with ``experts_implementation="grouped_mm"``.
    ``act`` lets the same block carry SReLU-type experts (``gate_up_proj`` of F rows).
    counts: "histc" (upstream) or "bincount"."""

    def __init__(self, act="swiglu_chunk", hidden=H, ffn=FF, counts="histc", bias=False):
        super().__init__()
        self.act, _, mult = ACTIVATIONS[act] if act in ACTIVATIONS else (globals()[act], None, 2)
        self.gate_up_proj = _param(G, mult * ffn, hidden)
        self.down_proj = _param(G, hidden, ffn)
        self.gate_up_proj_bias = _param(G, mult * ffn) if bias else None
        self.down_proj_bias = _param(G, hidden) if bias else None
        self.counts, self.num_experts = counts, G

    def forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k, num_tokens = top_k_index.size(-1), hidden_states.size(0)
        final = torch.zeros_like(hidden_states)
        expert_ids = top_k_index.reshape(-1)
        token_idx = torch.arange(num_tokens).unsqueeze(1).expand(-1, num_top_k).reshape(-1)
        perm = torch.argsort(expert_ids, stable=True)
        inv_perm = torch.argsort(perm, stable=True)
        sample_weights = top_k_weights.reshape(-1)
        current = hidden_states[token_idx]
        expert_ids_g, sample_weights_g, current_g = expert_ids[perm], sample_weights[perm], current[perm]
        if self.counts == "histc":
            per_expert = torch.histc(expert_ids_g.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        else:
            per_expert = torch.bincount(expert_ids_g, minlength=self.num_experts)
        offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
        gate_up = torch._grouped_mm(current_g, self.gate_up_proj.transpose(-2, -1), offs=offsets)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[expert_ids_g]
        hidden = self._apply_gate(gate_up)
        out = torch._grouped_mm(hidden, self.down_proj.transpose(-2, -1), offs=offsets)
        if self.down_proj_bias is not None:
            out = out + self.down_proj_bias[expert_ids_g]
        out = out * sample_weights_g.unsqueeze(-1)
        out = out[inv_perm]
        final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def _apply_gate(self, gate_up):
        return self.act(gate_up)


class GptOssExperts(HFGroupedMMExperts):
    """GPT-OSS's experts on the grouped_mm implementation: interleaved gate/up, clamped
    SwiGLU with alpha and ``(up + 1)``, biases on both projections. Not recognised."""

    alpha, limit = 1.702, 7.0

    def __init__(self):
        super().__init__(act="swiglu_chunk", bias=True)

    def _apply_gate(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE / Mixtral-style sparse block: router + experts (+ a shared expert)."""

    def __init__(self, experts: nn.Module, shared: bool = False):
        super().__init__()
        self.router, self.experts = Router(), experts
        self.shared_expert = SwiGLUMLP() if shared else None

    def forward(self, hidden_states):
        weights, ids = self.router(hidden_states)
        out = self.experts(hidden_states, ids, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden_states)
        return out

    def inputs(self, seed):
        return (_x(seed, T // TOP_K, H),)


class SwiGLUMLP(nn.Module):
    """A dense SwiGLU MLP (shared expert / torchtitan FeedForward): three nn.Linear."""

    def __init__(self, hidden=H, ffn=FF):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False, dtype=BF16)
        self.w2 = nn.Linear(ffn, hidden, bias=False, dtype=BF16)
        self.w3 = nn.Linear(hidden, ffn, bias=False, dtype=BF16)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralEagerExperts(nn.Module):
    """Mixtral's original eager experts: per-expert w1/w2/w3 nn.Linear, tokens picked with
    ``torch.where`` on a one-hot mask (data-dependent: Dynamo breaks the graph)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(SwiGLUMLP() for _ in range(G))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        mask = F.one_hot(top_k_index, num_classes=G).permute(2, 1, 0)
        for e in range(G):
            idx, top_x = torch.where(mask[e])
            current = hidden_states[top_x]
            out = self.experts[e](current) * top_k_weights[top_x, idx, None]
            final.index_add_(0, top_x, out.to(hidden_states.dtype))
        return final


class TitanGroupedExperts(nn.Module):
    """torchtitan's GroupedExperts (use_grouped_mm): w1 (gate) and w3 (up) as separate
    grouped GEMMs, ``offsets = cumsum(num_tokens_per_expert, dtype=int32)``."""

    def __init__(self, hidden=H, ffn=FF):
        super().__init__()
        self.w1, self.w2, self.w3 = _param(G, ffn, hidden), _param(G, hidden, ffn), _param(G, ffn, hidden)

    def forward(self, x, num_tokens_per_expert):
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)


class TitanMoE(nn.Module):
    """torchtitan's MoE: sigmoid/softmax top-k router, histc counts, TokenReorderer
    (argsort, scores[perm], perm // top_k), gather, grouped experts, shared expert,
    scores on the expert output (score_before_experts=False) or input (True), scatter_add."""

    def __init__(self, score_before_experts=False):
        super().__init__()
        self.gate = nn.Linear(H, G, bias=False, dtype=BF16)
        self.experts, self.shared_experts = TitanGroupedExperts(), SwiGLUMLP()
        self.score_before_experts, self.top_k = score_before_experts, TOP_K

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x).to(torch.float32), dim=1)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)
        # .float(): CPU histc has no int64 kernel (torchtitan runs it on CUDA on the int ids)
        num_tokens_per_expert = torch.histc(selected.view(-1).float(), bins=G, min=0, max=G)
        sorted_idx = torch.argsort(selected.view(-1), stable=True)
        top_scores_sorted = top_scores.view(-1)[sorted_idx]
        sorted_idx = (sorted_idx // self.top_k).reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x, dim=0, index=sorted_idx)
        if self.score_before_experts:
            routed_input = (routed_input.to(torch.float32) * top_scores_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_experts(x)
        if not self.score_before_experts:
            routed_output = (routed_output.to(torch.float32) * top_scores_sorted.reshape(-1, 1)).to(x.dtype)
        out = out.scatter_add(dim=0, index=sorted_idx, src=routed_output)
        return out.reshape(bs, slen, dim)

    def inputs(self, seed):
        return (_x(seed, 2, T // (2 * TOP_K), H),)


class Llama4TextExperts(nn.Module):
    """Llama4's TextExperts: bmm over (G, T/G, H) with gate_up_proj (G, H, 2F) and
    down_proj (G, F, H), ``up * act(gate)`` from a chunk."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = _param(G, H, 2 * FF), _param(G, FF, H)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(G, -1, H)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.bmm(up * self.act_fn(gate), self.down_proj).view(-1, H)

    def inputs(self, seed):
        return (_x(seed, T, H),)


class TwoLayerModel(nn.Module):
    """Two MoE layers (token-permutation SwiGLU with a shared expert, then a grouped_mm
    SReLU block) between attention, norms and residuals that must stay untouched."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(H, dtype=BF16), nn.RMSNorm(H, dtype=BF16)
        self.attn = nn.MultiheadAttention(H, 2, batch_first=True, dtype=BF16)
        self.moe1 = SparseMoeBlock(HFGroupedMMExperts("swiglu_chunk"), shared=True)
        self.moe2 = SparseMoeBlock(HFGroupedMMExperts("srelu_pow"))

    def forward(self, x):
        h = x + self.attn(self.norm1(x), self.norm1(x), self.norm1(x), need_weights=False)[0]
        flat = h.view(-1, H)
        flat = flat + self.moe1(self.norm2(flat))
        return flat + self.moe2(self.norm2(flat))

    def inputs(self, seed):
        return (_x(seed, 2, T // (2 * TOP_K), H),)


# ----------------------------------------------------------------------------- transformers 5.x, release by release


class ReLUSquared(nn.Module):
    """transformers' ``ACT2FN["relu2"]`` (ReLUSquaredActivation): relu, then torch.square."""

    def forward(self, x):
        return torch.square(F.relu(x))


HF_RELEASES = ("5.0", "5.2", "5.4", "5.6", "5.8", "5.17", "5.18", "5.20")


class HFExpertsRelease(nn.Module):
    """transformers' ``grouped_mm_experts_forward`` (``integrations/moe.py``) as each 5.x
    release spells it, re-created in plain PyTorch from the released wheels. ``release`` is
    the first release of a spelling, in force until the next one listed:

      5.0   argsort; x gathered by token_idx, then by perm; inv_perm = argsort(perm); prob
            column ``top_k_weights.reshape(-1, 1)[perm]``; ``torch._grouped_mm`` direct
      5.2   ``_grouped_mm`` helper: ``F.grouped_mm(input.to(weight.dtype), ...)``;
            ``sample_weights_g.unsqueeze(-1)``
      5.4   ``has_gate`` / ``act_fn`` (non-gated ``up_proj`` experts), inv_perm by index_put
            (and transformers' fallback op for non-bf16 weights under compile: not here)
      5.6   expert ids clamped before the sort (expert-parallel sentinels land in the last
            group); ``weighted_out.masked_fill_(invalid_g[:, None], 0.0)`` after the prob
      5.8   (to 5.16) ``torch.sort``, ``hidden[perm // top_k]``, sentinels sorted to the tail
            and left out of the offsets; ``x.masked_fill_(m, 0.0)`` before fc1 and
            ``weighted_out.masked_fill_(m, 0.0)`` after the prob, always
      5.17  ``x.masked_fill_(m, 0.0)``, then ``proj_out.masked_fill(m, 0.0)`` after fc1 and
            after fc2 (before the prob), always
      5.18  (5.18-5.19) the 5.17 masks only under expert parallelism (``ep=True``)
      5.20  (5.20-5.24) and an optional post-expert norm after fc2 (``post_norm=True``)

    act: "silu" (gated: ``gate_up_proj`` (G, 2F, H), ``act_fn(gate) * up`` of a chunk;
    Qwen3-MoE, Mixtral, OLMoE, DeepSeek) or "relu2" (``up_proj`` (G, F, H), ``act_fn(h)``;
    Nemotron-H). ep: expert ids >= G are sentinels (the 5.18+ masks are applied)."""

    def __init__(self, release, act="silu", ep=False, post_norm=False, bias=False, hidden=H, ffn=FF):
        super().__init__()
        assert release in HF_RELEASES, release
        self.release, self.ep, self.num_experts = release, ep, G
        self.has_gate = act == "silu"
        self.act_fn = nn.SiLU() if self.has_gate else ReLUSquared()
        if self.has_gate:
            self.gate_up_proj = _param(G, 2 * ffn, hidden)
        else:
            self.up_proj = _param(G, ffn, hidden)
        self.down_proj = _param(G, hidden, ffn)
        self.has_bias = bias
        self.up_bias = _param(G, (2 if self.has_gate else 1) * ffn) if bias else None
        self.post_expert_norm = nn.RMSNorm(hidden, dtype=BF16) if post_norm else None

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _mm(self, x, w, offsets):
        if self.release == "5.0":
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        return F.grouped_mm(x.to(w.dtype), w.transpose(-2, -1), offs=offsets)

    def _fc1(self, x, offsets, expert_ids_g):
        w = self.gate_up_proj if self.has_gate else self.up_proj
        out = self._mm(x, w, offsets)
        if self.up_bias is not None:
            bias = self.up_bias[expert_ids_g]
            out = out + bias if self.release in ("5.0", "5.2", "5.4", "5.6") else out.add_(bias)
        return out

    def _act(self, h):
        return self._apply_gate(h) if self.has_gate else self.act_fn(h)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        r = self.release
        num_top_k, num_tokens, hidden_dim = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
        if r in ("5.0", "5.2", "5.4", "5.6"):
            token_idx = torch.arange(num_tokens).unsqueeze(1).expand(-1, num_top_k).reshape(-1)
            expert_ids = top_k_index.reshape(-1)
            if r == "5.0":
                sample_weights = top_k_weights.reshape(-1, 1)
            else:
                sample_weights = top_k_weights.reshape(-1)
            if r == "5.6":
                invalid_mask = expert_ids >= self.num_experts
                expert_ids = expert_ids.clamp(0, self.num_experts - 1)
                perm = torch.argsort(expert_ids)
                selected_hidden_states_g = hidden_states[token_idx[perm]]
            else:
                selected_hidden_states = hidden_states[token_idx]
                perm = torch.argsort(expert_ids)
                selected_hidden_states_g = selected_hidden_states[perm]
            if r == "5.0":
                inv_perm = torch.argsort(perm)
            else:
                inv_perm = torch.empty_like(perm)
                inv_perm[perm] = torch.arange(perm.size(0))
            expert_ids_g = expert_ids[perm]
            sample_weights_g = sample_weights[perm]
            per_expert = torch.histc(expert_ids_g.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
            offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
            out = self._mm(self._act(self._fc1(selected_hidden_states_g, offsets, expert_ids_g)), self.down_proj,
                           offsets)
            weighted_out = out * (sample_weights_g if r == "5.0" else sample_weights_g.unsqueeze(-1))
            if r == "5.6":
                weighted_out.masked_fill_(invalid_mask[perm].unsqueeze(-1), 0.0)
            weighted_out = weighted_out[inv_perm]
            return weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)

        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        selected_hidden_states_g = hidden_states[perm // num_top_k]
        sample_weights_g = sample_weights[perm]
        tokens_per_expert = torch.histc(expert_ids_g.float(), bins=self.num_experts, min=0,
                                        max=self.num_experts - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        sentinel_mask = None
        if r in ("5.8", "5.17") or self.ep:
            sentinel_mask = (expert_ids_g >= self.num_experts).unsqueeze(-1)
            expert_ids_g.clamp_(max=self.num_experts - 1)
        if sentinel_mask is not None:
            selected_hidden_states_g.masked_fill_(sentinel_mask, 0.0)
        proj_out = self._fc1(selected_hidden_states_g, offsets, expert_ids_g)
        if sentinel_mask is not None and r != "5.8":
            proj_out = proj_out.masked_fill(sentinel_mask, 0.0)
        proj_out = self._mm(self._act(proj_out), self.down_proj, offsets)
        if sentinel_mask is not None and r != "5.8":
            proj_out = proj_out.masked_fill(sentinel_mask, 0.0)
        if self.post_expert_norm is not None:
            proj_out = self.post_expert_norm(proj_out)
        weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
        if sentinel_mask is not None and r == "5.8":
            weighted_out.masked_fill_(sentinel_mask, 0.0)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0))
        weighted_out = weighted_out[inv_perm]
        return weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


class SentinelMoeBlock(SparseMoeBlock):
    """A sparse block whose router marks every fifth routed slot as an expert-parallel
    sentinel (expert id G, weight 0), as transformers' EP dispatch does for tokens routed
    to experts on other ranks."""

    def forward(self, hidden_states):
        weights, ids = self.router(hidden_states)
        sentinel = (torch.arange(ids.numel()).view_as(ids) % 5) == 0
        ids = torch.where(sentinel, G, ids)
        weights = torch.where(sentinel, 0.0, weights)
        return self.experts(hidden_states, ids, weights)


class DataDependentRowsMoE(nn.Module):
    """The local half of an expert-parallel layer in one graph, as a single process: the
    rows this rank computes are data-dependent (``nonzero`` on the routing picks the rows
    for local experts, ``counts.tolist()`` + ``repeat_interleave`` build the row order), so
    T is an unbacked size. Needs ``capture_scalar_outputs`` and
    ``capture_dynamic_output_shape_ops``. SwiGLU grouped_mm experts, prob on the output."""

    def __init__(self, hidden=H, ffn=FF):
        super().__init__()
        self.w13, self.w2 = _param(G, 2 * ffn, hidden), _param(G, hidden, ffn)

    def forward(self, x, ids, probs):
        local = (ids < G).nonzero().squeeze(-1)                      # rows routed to this rank
        rows, experts, p = x[local], ids[local], probs[local]
        order = torch.argsort(experts, stable=True)
        counts = torch.histc(experts.float(), bins=G, min=0, max=G - 1).to(torch.int64)
        sizes = counts.tolist()                                       # host sizes, as an all-to-all split
        for s in sizes:
            torch._check(s >= 0)
        group_of_row = torch.repeat_interleave(torch.arange(G), counts, output_size=sum(sizes))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs, ps = rows[order], p[order]
        h = torch._grouped_mm(xs, self.w13.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offs)
        y = y * ps.unsqueeze(-1) + 0 * group_of_row.unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add(0, local[order], y)

    def inputs(self, seed):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 2 * G, (T,), generator=gen)             # ids >= G live on another rank
        return _x(seed, T, H), ids, _probs(seed, T)


class TitanGroupedExperts030(nn.Module):
    """torchtitan 0.3.0's ``GroupedExperts`` (models/common/moe.py): ``w1_EFD``, ``w3_EFD``
    (G, F, H) and ``w2_EDF`` (G, H, F) in any dtype, cast to bf16 at each grouped GEMM."""

    def __init__(self, dtype=BF16, hidden=H, ffn=FF):
        super().__init__()
        self.num_experts = G
        self.w1_EFD, self.w3_EFD = _param(G, ffn, hidden, dtype=dtype), _param(G, ffn, hidden, dtype=dtype)
        self.w2_EDF = _param(G, hidden, ffn, dtype=dtype)

    def forward(self, x_RD, num_tokens_per_expert_E):
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(self._grouped_mm(A=x_RD.bfloat16(), B_t=self.w1_EFD.bfloat16().transpose(-2, -1),
                                       offs=offsets_E))
        h_RF = h_RF * self._grouped_mm(A=x_RD.bfloat16(), B_t=self.w3_EFD.bfloat16().transpose(-2, -1),
                                       offs=offsets_E)
        return self._grouped_mm(A=h_RF, B_t=self.w2_EDF.bfloat16().transpose(-2, -1), offs=offsets_E).type_as(x_RD)

    def _grouped_mm(self, *, A, B_t, offs):
        return torch._grouped_mm(A, B_t, offs=offs)


class TitanMoE030(nn.Module):
    """torchtitan 0.3.0's ``MoE`` with the ``LocalTokenDispatcher`` (no expert parallelism),
    re-created from models/common/moe.py and token_dispatcher.py: sigmoid top-k router (the
    gate run in fp32), counts from a one-hot routing map, dispatch by a stable argsort
    (``x[idx // top_k]``), the grouped experts, scores applied in ``combine`` after them
    (``(out.float() * scores[:, None]).to(dtype)``), ``scatter_add`` back (torchtitan's
    ``deterministic_scatter_add`` op is ``out.scatter_add`` under deterministic mode), and a
    shared SwiGLU expert. ``dtype`` is the parameters' (fp32 master weights: the experts
    cast them to bf16 themselves)."""

    def __init__(self, dtype=BF16):
        super().__init__()
        self.gate = nn.Linear(H, G, bias=False, dtype=dtype)
        self.experts = TitanGroupedExperts030(dtype)
        self.shared_experts = SwiGLUMLP().to(dtype)
        self.top_k = TOP_K

    def forward(self, x_BLD):
        B, L, D = x_BLD.shape
        with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
            scores_BLE = self.gate(x_BLD)
        scores_BLE = torch.sigmoid(scores_BLE.float())
        _, topk_expert_ids_BLK = torch.topk(scores_BLE, k=self.top_k, dim=-1, sorted=False)
        topk_scores_BLK = scores_BLE.gather(dim=-1, index=topk_expert_ids_BLK)
        routing_map_BLE = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(-1, topk_expert_ids_BLK, True)
        num_tokens_per_expert_E = routing_map_BLE.sum(dim=(0, 1))
        x_TD = x_BLD.view(B * L, D)
        idx_N = torch.argsort(topk_expert_ids_BLK.view(-1), stable=True)
        scores_N = topk_scores_BLK.view(-1)[idx_N]
        idx_N = idx_N // self.top_k
        routed_output_RD = self.experts(x_TD[idx_N], num_tokens_per_expert_E)
        routed_output_RD = (routed_output_RD.to(torch.float32) * scores_N.reshape(-1, 1)).to(routed_output_RD.dtype)
        out_TD = torch.zeros_like(x_TD).scatter_add(0, idx_N.reshape(-1, 1).expand(-1, D), routed_output_RD)
        return (out_TD + self.shared_experts(x_TD)).view(B, L, D)

    def inputs(self, seed):
        return (_x(seed, 2, T // (2 * TOP_K), H, dtype=self.gate.weight.dtype),)


class MaskedGroupedMM(nn.Module):
    """A grouped_mm SReLU / SwiGLU block with a bool row mask applied at ``where``:
    "x" (in place, before fc1), "fc1" (fc1 output), "d" (fc2 input), "fc2" (fc2 output,
    before the prob), "out" (after the prob), "out_inplace" (``masked_fill_`` after the
    prob); ``form``: "masked_fill", "where" (``where(m, 0, t)``), "keep_where"
    (``where(~m, t, 0)``), "mul" (``t * (~m).to(dtype)``). Near-misses: ``form="fill_one"``
    (fills 1.0), ``extra="clamp"`` (a clamp on fc1's output), ``extra="norm"`` (an RMSNorm on
    fc2's output before the prob, as transformers' post-expert norm)."""

    def __init__(self, where="fc1", form="masked_fill", act="srelu_pow", extra=None):
        super().__init__()
        self.act, _, mult = ACTIVATIONS[act]
        self.where, self.form, self.extra = where, form, extra
        self.w1, self.w2 = _param(G, mult * FF, H), _param(G, H, FF)
        self.norm = nn.RMSNorm(H, dtype=BF16) if extra == "norm" else None

    def _mask(self, t, m):
        if self.form == "masked_fill":
            return t.masked_fill(m, 0.0)
        if self.form == "where":
            return torch.where(m, 0.0, t)
        if self.form == "keep_where":
            return torch.where(~m, t, 0.0)
        if self.form == "mul":
            return t * (~m).to(t.dtype)
        return t.masked_fill(m, 1.0)  # fill_one

    def forward(self, x, offs, probs, mask):
        m = mask.unsqueeze(-1)
        if self.where == "x":
            x = x.clone()
            x.masked_fill_(m, 0.0)
        h = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)
        if self.extra == "clamp":
            h = h.clamp(max=7.0)
        if self.where == "fc1":
            h = self._mask(h, m)
        d = self.act(h)
        if self.where == "d":
            d = self._mask(d, m)
        y = torch._grouped_mm(d, self.w2.transpose(-2, -1), offs=offs)
        if self.where == "fc2":
            y = self._mask(y, m)
        if self.norm is not None:
            y = self.norm(y)
        y = y * probs.unsqueeze(-1)
        if self.where == "out":
            y = self._mask(y, m)
        if self.where == "out_inplace":
            y.masked_fill_(m, 0.0)
        return y

    def inputs(self, seed):
        offs = torch.cumsum(_sizes(seed), 0, dtype=torch.int32)
        mask = (torch.arange(T) % 3) == 0
        return _x(seed, T, H), offs, _probs(seed, T), mask
