"""A mixture-of-experts decoder (Qwen3-MoE; DeepSeek-V3's router options) you can read in one sitting.

The attention is Qwen3's: grouped-query, an explicit head_dim, an RMSNorm on each query and key
head before rotary (the Llama family's RMSNorm and rotary are reused). Every layer's MLP is a
sparse block (`MoEBlock`): a token-choice top-k router (softmax or sigmoid scores, optional
renormalization of the chosen k, DeepSeek's score-correction bias for aux-loss-free balancing),
SwiGLU experts held as two 3-D weights, and optional shared experts every token passes through.
Dropless: every (token, choice) copy is computed (loom.models.moe.dispatch), locally or across
expert-parallel ranks (`ep_group`, set by `apply_expert_parallel`).

Parameter names are transformers 5's (`model.layers.3.mlp.gate.weight` [E, d],
`mlp.experts.gate_up_proj` [E, 2I, d], `mlp.experts.down_proj` [E, d, I]), so those checkpoints
load name for name; the per-expert layout (`mlp.experts.7.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.7.w1.weight`) is converted on load (loom.models.moe.hf_names).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from loom.models.context_parallel import context_attention, split_inputs, whole_of
from loom.models.init import Rule
from loom.models.llama.network import LlamaBody, RMSNorm, RotaryEmbedding, apply_rotary
from loom.models.moe.dispatch import dispatch_all_to_all, dispatch_local, expert_load
from loom.models.pipeline_split import PipelineSplit


def moe_rule(std: float = 0.02) -> Rule:
    """transformers' Qwen3-MoE init: every matrix (router and 3-D experts too) normal(0, 0.02),
    unit norms, a zero correction bias."""

    def rule(name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        if name.endswith("e_score_correction_bias"):
            return "zeros", 0.0
        if name.endswith("norm.weight"):
            return "ones", 0.0
        return "normal", std

    return rule


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: `torch._grouped_mm`'s
    backward refuses a stride-0 gradient (what `out.sum()` sends back)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`: an expert-parallel rank's
    expert gradients sum the tokens of all its ep peers, so FSDP2's mean over the ranks holding
    the same experts (dp / ep of them) is ep times the data-parallel mean; 1 / ep here makes it
    that mean. (FSDP2's own `set_gradient_divide_factor` needs a PREMUL_SUM reduction gloo lacks.)"""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def grouped_mm_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands: float32/bf16/fp16, and every row
    stride a multiple of 16 bytes (checked by torch; else the per-expert loop)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(x) and x.dtype != torch.bfloat16:  # the fake kernel (a rehearsal) is CUDA's: bf16 only
        return False
    return all(w.dtype == x.dtype and (w.shape[-1] * w.element_size()) % 16 == 0
               and (w.shape[-2] * w.element_size()) % 16 == 0 for w in weights)


class Experts(nn.Module):
    """E SwiGLU experts as two 3-D weights (transformers 5's fused layout): for the tokens of
    expert e, down_e(silu(gate_e x) * up_e x) with [gate_e; up_e] = gate_up_proj[e]. Under
    expert parallelism a rank holds only its experts' rows (`apply_expert_parallel`)."""

    def __init__(self, num_experts: int, d_model: int, intermediate: int, grouped_mm: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, intermediate))
        self.grouped_mm = grouped_mm
        self.grad_scale = 1.0  # 1 / ep under expert parallelism (`_ScaleGrad`)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: tokens sorted by expert [T, d]; counts [E_local]: how many each expert has."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if hasattr(gate_up, "to_local"):  # expert parallelism: this rank's experts (a DTensor's shard)
            gate_up, down = gate_up.to_local(), down.to_local()
        if self.grad_scale != 1.0:
            gate_up, down = _ScaleGrad.apply(gate_up, self.grad_scale), _ScaleGrad.apply(down, self.grad_scale)
        if gate_up.dtype != x.dtype:  # autocast does not reach the grouped matmul's operands
            gate_up, down = gate_up.to(x.dtype), down.to(x.dtype)
        if self.grouped_mm and grouped_mm_ok(x, gate_up, down):
            offs = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)
            g, u = _ContiguousGrad.apply(h).chunk(2, dim=-1)
            out = torch._grouped_mm((F.silu(g) * u).contiguous(), down.transpose(-2, -1), offs=offs)
            return _ContiguousGrad.apply(out)
        return self._loop(x, counts, gate_up, down)

    @staticmethod
    def _loop(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """One matmul pair per expert: where grouped matmul is unavailable (float64, odd widths)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # a rehearsal's counts are real host values (dispatch._counts)
            sizes = counts.tolist()
        outs = []
        for e, part in enumerate(x.split(sizes)):
            g, u = F.linear(part, gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(g) * u, down[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


class Router(nn.Module):
    """Token-choice top-k. Scores softmax (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3) over
    the experts, in fp32; the choice may add `e_score_correction_bias` (aux-loss-free
    balancing: it changes which experts are chosen, never the weights); the chosen k scores
    renormalized when `norm_topk_prob`, times `routed_scaling_factor`."""

    def __init__(self, num_experts: int, d_model: int, top_k: int, score_func: str, norm_topk_prob: bool,
                 routed_scaling_factor: float, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.top_k, self.score_func, self.norm_topk_prob = top_k, score_func, norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> (top_idx [N, k], top_w [N, k] in x's dtype, scores [N, E] fp32)."""
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        top_idx = choice.topk(self.top_k, dim=-1).indices
        top_w = scores.gather(-1, top_idx)
        if self.norm_topk_prob:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_idx, (top_w * self.routed_scaling_factor).to(x.dtype), scores


class SwiGLU(nn.Module):
    """The shared experts (DeepSeek's `shared_experts`): one dense SwiGLU every token passes."""

    def __init__(self, d_model: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, intermediate, bias=False)
        self.up_proj = nn.Linear(d_model, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def sequence_balance_loss(scores: torch.Tensor, top_idx: torch.Tensor, batch: int, context=None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20), before its coefficient: per
    sequence, sum_i f_i * P_i with f_i = E / (k T) * (tokens choosing i) and P_i the mean
    normalized score of i; averaged over sequences. A mean per sequence, so micro-batches
    averaged by gradient accumulation give the big batch's value (tests/test_moe.py).

    Context-parallel (`context`, a rank holding T / cp tokens of each sequence): the choices are
    counted over the whole sequence (all-reduced; they carry no gradient) and the loss, linear in
    P, is this rank's share of it (`context_parallel.whole_of`: its gradient, the value the whole)."""
    N, E = scores.shape
    k, T = top_idx.shape[1], N // batch
    chosen = torch.zeros(batch, T * k, E, device=scores.device).scatter_(-1, top_idx.view(batch, T * k, 1), 1.0)
    counts, length = chosen.sum(1), T                                   # [B, E]
    if context is not None:
        counts, length = funcol.all_reduce(counts, "sum", context.group), T * context.size
    f = counts * (E / (k * length))
    p = (scores / scores.sum(-1, keepdim=True)).view(batch, T, E).sum(1) / length  # [B, E]
    loss = (f * p).sum(-1).mean()
    return loss if context is None else whole_of(loss, context)


class MoEBlock(nn.Module):
    """Router -> dropless dispatch to the routed experts (+ shared experts). Keeps, for the
    module's loss and metrics, this forward's balance loss and tokens per expert."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_intermediate_size: int, score_func: str, norm_topk_prob: bool,
                 routed_scaling_factor: float, correction_bias: bool, grouped_mm: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate = Router(num_experts, d_model, top_k, score_func, norm_topk_prob, routed_scaling_factor,
                           correction_bias)
        self.experts = Experts(num_experts, d_model, moe_intermediate_size, grouped_mm)
        self.shared_experts = SwiGLU(d_model, shared_intermediate_size) if shared_intermediate_size else None
        self.ep_group = None  # a ProcessGroup: experts split over its ranks (apply_expert_parallel)
        self.context = None  # strategy.cp: the balance loss counts the whole sequences (loom.models.context_parallel)
        self.balance_loss: torch.Tensor | None = None
        self.load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        top_idx, top_w, scores = self.gate(flat)
        if self.ep_group is None:
            out = dispatch_local(flat, top_idx, top_w, self.num_experts, self.experts)
        else:
            out = dispatch_all_to_all(flat, top_idx, top_w, self.num_experts, self.experts, self.ep_group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.training:
            self.balance_loss = sequence_balance_loss(scores, top_idx, B, self.context)
        self.load = expert_load(top_idx.detach(), self.num_experts)
        return out.view(B, T, d)


class Attention(nn.Module):
    """Qwen3's: q/k/v/o projections with an explicit head_dim, RMSNorm on each q and k head
    (`qk_norm`; Mixtral's has none)."""

    def __init__(self, d_model: int, n_head: int, n_kv_heads: int, head_dim: int, eps: float, qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(d_model, n_head * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()  # Mixtral: none
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.context = None  # strategy.cp: this rank's ContextShard (loom.models.context_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = (context_attention(self, q, k, v, None) if self.context is not None
             else F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]))
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MoEDecoderLayer(nn.Module):
    """One pre-norm block with a sparse MLP: the FSDP and activation-checkpointing unit."""

    def __init__(self, d_model: int, n_head: int, n_kv_heads: int, head_dim: int, eps: float, qk_norm: bool,
                 moe: dict) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d_model, eps)
        self.self_attn = Attention(d_model, n_head, n_kv_heads, head_dim, eps, qk_norm)
        self.post_attention_layernorm = RMSNorm(d_model, eps)
        self.mlp = MoEBlock(d_model, **moe)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoETransformer(nn.Module):
    """transformers' `Qwen3MoeForCausalLM`: token ids (B, T) -> logits (B, T, vocab_size)."""

    pipeline_split = PipelineSplit(layers="model.layers", first=("model.embed_tokens",),
                                   last=("model.norm", "lm_head"))

    def __init__(self, n_layer: int, n_head: int, n_kv_heads: int, head_dim: int, d_model: int,
                 vocab_size: int, block_size: int, num_experts: int, experts_per_token: int,
                 moe_intermediate_size: int, shared_intermediate_size: int = 0, score_func: str = "softmax",
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, aux_loss_coef: float = 0.0,
                 bias_update_rate: float = 0.0, grouped_mm: bool = True, qk_norm: bool = True,
                 rope_theta: float = 1e6, rms_norm_eps: float = 1e-6, tie_embeddings: bool = False) -> None:
        super().__init__()
        self.block_size, self.n_layer = block_size, n_layer
        self.aux_loss_coef, self.bias_update_rate = aux_loss_coef, bias_update_rate
        moe = dict(num_experts=num_experts, top_k=experts_per_token, moe_intermediate_size=moe_intermediate_size,
                   shared_intermediate_size=shared_intermediate_size, score_func=score_func,
                   norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
                   correction_bias=bias_update_rate > 0, grouped_mm=grouped_mm)
        layers = [MoEDecoderLayer(d_model, n_head, n_kv_heads, head_dim, rms_norm_eps, qk_norm, moe)
                  for _ in range(n_layer)]
        # the body under `model.` (embeddings, layers, final norm, rotary) is the Llama family's
        self.model = LlamaBody(vocab_size, d_model, layers, rms_norm_eps, RotaryEmbedding(head_dim, rope_theta, None))
        self.lm_head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)
        self.context = None  # strategy.cp: forward keeps this rank's slice of each sequence
        w = self.model.embed_tokens.weight
        if not (w.is_meta or hasattr(w, "ds_id")):  # meta or ZeRO-3: the worker initializes (models.construct)
            self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        from loom.models.init import NamedInit, initialize

        seed = torch.initial_seed() if seed is None else seed
        initialize(self, NamedInit(seed, moe_rule()), self.model.embed_tokens.weight.device)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(idx)

    def layer_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cp = self.context  # context-parallel: this slice's positions in the whole sequence
        if cp is None:
            return self.model.rotary_emb(x.shape[1], x.device, x.dtype)
        return self.model.rotary_emb.at(cp.positions(x.shape[1] * cp.size, x.device)[None], x.dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.model.norm(x)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.model.embed_tokens.weight)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) (`pos` is refused at validation: no document masks); context-parallel,
        those of this rank's slice, rotated at its positions in the whole sequence."""
        idx, _, _ = split_inputs(self, idx, None)
        x = self.embed(idx)
        cos, sin = self.layer_inputs(x)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.head(x)

    def moe_blocks(self) -> list[MoEBlock]:
        """The sparse blocks this rank holds (a pipeline stage: its own layers only)."""
        return [m for m in self.modules() if isinstance(m, MoEBlock)]

    def balance_loss(self) -> torch.Tensor | None:
        """aux_loss_coef x the sum over layers of the last forward's sequence-wise balance loss."""
        losses = [b.balance_loss for b in self.moe_blocks() if b.balance_loss is not None]
        return self.aux_loss_coef * torch.stack(losses).sum() if losses and self.aux_loss_coef else None

    @torch.no_grad()
    def update_correction_bias(self, loads: list[torch.Tensor]) -> None:
        """Aux-loss-free balancing (DeepSeek-V3 §2.1.2): after each step, each layer's bias
        rises by `bias_update_rate` for an expert below the mean load and falls for one above.
        `loads`: per block, tokens per expert summed over the step (and over data-parallel ranks)."""
        for block, load in zip(self.moe_blocks(), loads, strict=True):
            bias = block.gate.e_score_correction_bias
            if bias is not None:
                bias += self.bias_update_rate * torch.sign(load.float().mean() - load.float()).to(bias.dtype)
