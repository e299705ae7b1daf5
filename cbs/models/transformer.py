"""Decoder-only Transformer language model built from `cbs.models.layers` (pre-LN, causal).

Letters: B batch, T positions (context length), D model width, H heads, K = D / H head width,
F MLP width, V vocabulary, L layers, S key positions.

    h_0 = E[x] (+ P[t] with learned positions)
    h_l = h_{l-1} + Attn(LN(h_{l-1})),  h_l = h_l + W_2 gelu(W_1 LN(h_l))
    logits = LN(h_L) W_out            (W_out = E^T when embeddings are tied)

Attention is softmax(q k^T / sqrt(K) + causal mask) v with separate q, k, v, o
`cbs.models.layers.Linear` projections. Rotary positions (Su et al. 2021, eq. 34, "rotate
half" layout) rotate q and k and add no parameters. Initialisation (GPT-2 style):
embeddings and projections N(0, 0.02^2), the residual output projections (attention o and
MLP W_2) N(0, (0.02 / sqrt(2L))^2), biases zero, LN scale one.

Named sizes (SIZES; parameters counted without embeddings, head, positions, final LN):
    tiny   D=32,  L=2,  H=2,  F=128     ~25K   (CPU tests, T=32)
    small  D=128, L=4,  H=4,  F=512     ~0.8M
    10m    D=384, L=6,  H=6,  F=1536    ~10.6M
    100m   D=768, L=12, H=12, F=3072    ~85M   (+ 2·V·D for untied embedding and head)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from cbs.models import layers
from cbs.models.registry import ModelInputs, check_positive, register

__all__ = [
    "POSITIONS", "SIZES", "Block", "CausalSelfAttention", "TransformerLM", "TransformerSize",
    "build_transformer", "causal_attention", "lm_flops_per_token", "resolve_row", "rotary",
    "transformer_fields", "transformer_flops",
]

POSITIONS = ("learned", "rotary")


@dataclasses.dataclass(frozen=True)
class TransformerSize:
    """One row of a size table (`SIZES`, `cbs.models.lm.LM_SIZES`)."""

    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int


SIZES: dict[str, TransformerSize] = {
    "tiny": TransformerSize(32, 2, 2, 128),
    "small": TransformerSize(128, 4, 4, 512),
    "10m": TransformerSize(384, 6, 6, 1536),
    "100m": TransformerSize(768, 12, 12, 3072),
}


def resolve_row(c: ml_collections.ConfigDict, table: dict[str, TransformerSize]) -> TransformerSize:
    """The sizes config `c` asks for: its `size` row of `table`, overridden by fields not 0."""
    if c.size not in table:
        raise ValueError(f"model.size={c.size!r} is not one of {tuple(table)}")
    fields = [f.name for f in dataclasses.fields(TransformerSize)]
    for field in fields:
        check_positive(c, field, allow_zero=True)
    return TransformerSize(*(c[f] or getattr(table[c.size], f) for f in fields))


def rotary(x_BxTxHxK: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotates feature pairs (i, i + K/2) of each head by angle t · base^(-2i/K)."""
    t, k = x_BxTxHxK.shape[1], x_BxTxHxK.shape[-1]
    inv_freq_K2 = base ** (-jnp.arange(0, k // 2, dtype=jnp.float32) * 2.0 / k)
    angle_TxK2 = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq_K2[None, :]
    cos_Tx1xK2, sin_Tx1xK2 = jnp.cos(angle_TxK2)[:, None], jnp.sin(angle_TxK2)[:, None]
    x1, x2 = x_BxTxHxK[..., : k // 2], x_BxTxHxK[..., k // 2:]
    out = jnp.concatenate([x1 * cos_Tx1xK2 - x2 * sin_Tx1xK2, x2 * cos_Tx1xK2 + x1 * sin_Tx1xK2],
                          axis=-1)
    return out.astype(x_BxTxHxK.dtype)


def causal_attention(q_BxTxHxK: jax.Array, k_BxSxHxK: jax.Array, v_BxSxHxK: jax.Array) -> jax.Array:
    """softmax(q kᵀ / √K + causal mask) v per head, scores and softmax in float32."""
    t, k = q_BxTxHxK.shape[1], q_BxTxHxK.shape[-1]
    scores_BxHxTxS = jnp.einsum("bthk,bshk->bhts", q_BxTxHxK, k_BxSxHxK,
                                preferred_element_type=jnp.float32) / math.sqrt(k)
    causal_TxS = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores_BxHxTxS = jnp.where(causal_TxS, scores_BxHxTxS, jnp.finfo(jnp.float32).min)
    probs_BxHxTxS = jax.nn.softmax(scores_BxHxTxS, axis=-1).astype(v_BxSxHxK.dtype)
    return jnp.einsum("bhts,bshk->bthk", probs_BxHxTxS, v_BxSxHxK)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with separate q, k, v, o projections."""

    def __init__(self, d_model: int, num_heads: int, *, positions: str, use_bias: bool,
                 out_std: float, rngs: nnx.Rngs):
        if d_model % num_heads:
            raise ValueError(f"model.num_heads={num_heads} does not divide d_model={d_model}")
        self.num_heads, self.rotary = num_heads, positions == "rotary"
        if self.rotary and (d_model // num_heads) % 2:
            raise ValueError("rotary positions need an even head width d_model / num_heads")
        init = nnx.initializers.normal(0.02)
        self.q, self.k, self.v = (layers.Linear(d_model, d_model, use_bias=use_bias,
                                                kernel_init=init, rngs=rngs) for _ in range(3))
        self.o = layers.Linear(d_model, d_model, use_bias=use_bias,
                               kernel_init=nnx.initializers.normal(out_std), rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, d = x_BxTxD.shape
        split = lambda y: y.reshape(b, t, self.num_heads, d // self.num_heads)
        q_BxTxHxK, k_BxSxHxK, v_BxSxHxK = (split(p(x_BxTxD)) for p in (self.q, self.k, self.v))
        if self.rotary:
            q_BxTxHxK, k_BxSxHxK = rotary(q_BxTxHxK), rotary(k_BxSxHxK)
        return self.o(causal_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK).reshape(b, t, d))


class Block(nnx.Module):
    """Pre-LN residual block: x + Attn(LN(x)), then x + MLP(LN(x)) with a GELU MLP."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, positions: str,
                 use_bias: bool, out_std: float, rngs: nnx.Rngs):
        self.ln_attn = layers.LayerNorm(d_model, rngs=rngs)
        self.attn = CausalSelfAttention(d_model, num_heads, positions=positions,
                                        use_bias=use_bias, out_std=out_std, rngs=rngs)
        self.ln_mlp = layers.LayerNorm(d_model, rngs=rngs)
        self.fc_in = layers.Linear(d_model, d_ff, use_bias=use_bias,
                                   kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.fc_out = layers.Linear(d_ff, d_model, use_bias=use_bias,
                                    kernel_init=nnx.initializers.normal(out_std), rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x_BxTxD = x_BxTxD + self.attn(self.ln_attn(x_BxTxD))
        return x_BxTxD + self.fc_out(jax.nn.gelu(self.fc_in(self.ln_mlp(x_BxTxD))))


class TransformerLM(nnx.Module):
    """Token ids int32 [B, T] (T <= max_len) → next-token logits [B, T, V]."""

    couples_examples = False

    def __init__(self, vocab_size: int, max_len: int, *, d_model: int, num_layers: int,
                 num_heads: int, d_ff: int, positions: str = "rotary",
                 tie_embeddings: bool = False, use_bias: bool = False, rngs: nnx.Rngs):
        if positions not in POSITIONS:
            raise ValueError(f"model.positions={positions!r} is not one of {POSITIONS}")
        self.max_len, self.tie_embeddings = max_len, tie_embeddings
        out_std = 0.02 / math.sqrt(2 * num_layers)
        self.embed = layers.Embed(vocab_size, d_model, rngs=rngs)
        self.pos_embed = (layers.Embed(max_len, d_model, rngs=rngs)
                          if positions == "learned" else None)
        self.blocks = nnx.List([Block(d_model, num_heads, d_ff, positions=positions,
                                      use_bias=use_bias, out_std=out_std, rngs=rngs)
                                for _ in range(num_layers)])
        self.ln_final = layers.LayerNorm(d_model, rngs=rngs)
        self.head = (None if tie_embeddings else
                     layers.Linear(d_model, vocab_size, use_bias=False,
                                   kernel_init=nnx.initializers.normal(0.02), rngs=rngs))
        self.init_scheme = (f"embeddings and projections N(0, 0.02^2), residual outputs "
                            f"N(0, {out_std:.4g}^2), biases zero, LN scale one")
        self.description = (f"TransformerLM(D={d_model}, L={num_layers}, H={num_heads}, "
                            f"F={d_ff}, T={max_len}, V={vocab_size}, positions={positions}, "
                            f"{'tied' if tie_embeddings else 'untied'}, bias={use_bias})")

    def __call__(self, ids_BxT: jax.Array) -> jax.Array:
        b, t = ids_BxT.shape
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}")
        h_BxTxD = self.embed(ids_BxT)
        if self.pos_embed is not None:
            # Per-example position ids so the table's per-example gradient has the fast path.
            h_BxTxD = h_BxTxD + self.pos_embed(jnp.broadcast_to(jnp.arange(t), (b, t)))
        for block in self.blocks:
            h_BxTxD = block(h_BxTxD)
        h_BxTxD = self.ln_final(h_BxTxD)
        if self.head is None:
            return jnp.einsum("btd,vd->btv", h_BxTxD, self.embed.embedding[...])
        return self.head(h_BxTxD)


def transformer_fields() -> ml_collections.ConfigDict:
    """The `model` fields of "transformer"."""
    c = ml_collections.ConfigDict()
    c.size = "tiny"  # row of cbs.models.transformer.SIZES: "tiny" | "small" | "10m" | "100m"
    c.d_model = 0  # model width D; 0 = from size
    c.num_layers = 0  # number of blocks L; 0 = from size
    c.num_heads = 0  # attention heads H (must divide d_model); 0 = from size
    c.d_ff = 0  # MLP hidden width F; 0 = from size
    c.max_len = 0  # longest sequence (learned position table); 0 = input length T
    c.positions = "rotary"  # "rotary" (no parameters) | "learned" (table [max_len, D])
    c.tie_embeddings = False  # output head = embedding^T
    c.use_bias = False  # biases in the attention and MLP projections
    return c


def lm_flops_per_token(d_model: int, num_layers: int, d_ff: int, vocab_size: int,
                       seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward, no remat recompute):
    6·N_matmul + 6·L·T·D for attention scores and values (Kaplan et al. 2020, §2.1)."""
    n_matmul = num_layers * (4 * d_model**2 + 3 * d_model * d_ff) + d_model * vocab_size
    return 6.0 * n_matmul + 6.0 * num_layers * seq_len * d_model


def transformer_flops(c: ml_collections.ConfigDict, inputs: ModelInputs) -> float | None:
    """Training FLOPs of one sequence (the LM formula with a GELU MLP: 2·D·F where SwiGLU
    counts 3·D·F); None for a size not in the table."""
    if c.size not in SIZES:
        return None
    s = resolve_row(c, SIZES)
    seq_len = int(inputs.input_shape[-1]) if inputs.input_shape else 0
    return seq_len * lm_flops_per_token(s.d_model, s.num_layers, 2 * s.d_ff // 3,
                                        inputs.vocab_size or 0, seq_len)


@register("transformer", default_config=transformer_fields, flops=transformer_flops)
def build_transformer(c: ml_collections.ConfigDict, inputs: ModelInputs, rngs: nnx.Rngs
                      ) -> TransformerLM:
    if inputs.vocab_size is None:
        raise ValueError("model.name='transformer' needs vocab_size (a dataset with a vocabulary)")
    s = resolve_row(c, SIZES)
    check_positive(c, "max_len", allow_zero=True)
    return TransformerLM(inputs.vocab_size, c.max_len or int(inputs.input_shape[-1]),
                         **dataclasses.asdict(s), positions=c.positions,
                         tie_embeddings=c.tie_embeddings, use_bias=c.use_bias, rngs=rngs)
