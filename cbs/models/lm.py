"""Decoder-only language model in the shape pod-scale JAX models take: scanned, remat, bf16
(docs/guides/language_models.md). Letters as in `cbs.models.transformer`.

    h_0 = E[x]
    h_l = h_{l-1} + Attn(RMSNorm(h_{l-1})),  h_l = h_l + W_down (silu(W_gate u) ⊙ W_up u),
    u = RMSNorm(h_l)                              (SwiGLU, Shazeer 2020)
    logits = RMSNorm(h_L) W_head                  (W_head = E^T when embeddings are tied)

Attention is causal, with rotary positions and no biases. The L blocks are ONE `Block` whose
parameters carry a leading layer axis [L, ...] (`nnx.vmap`), run with `nnx.scan`, so compile
time does not grow with L. Parameters are float32; matmuls and activations run in
`compute_dtype`; normalisation statistics, softmax and the loss in float32.
`cbs.runtime.mesh.LM_RULES` shards by the parameter names (`embed`, `head`, `blocks/wq`, ...).

Named sizes (LM_SIZES; parameters counted without the embedding and head, V·D each):
    tiny   D=32,   L=2,  H=2,  F=64      ~21K      (CPU tests)
    small  D=256,  L=4,  H=4,  F=704     ~3.2M
    124m   D=768,  L=12, H=12, F=2048    ~85M      (+ V·D = 38.6M tied at V=50304: ~124M)
    350m   D=1024, L=24, H=16, F=2816    ~308M
    1b     D=2048, L=16, H=16, F=5632    ~822M     (+ V·D tied at V=50304 ~ 0.93B)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from cbs.models.registry import ModelInputs, check_positive, register
from cbs.models.transformer import (
    TransformerSize,
    causal_attention,
    lm_flops_per_token,
    resolve_row,
    rotary,
)

__all__ = [
    "ATTENTION", "DTYPES", "LM", "LM_SIZES", "REMAT_POLICIES", "Block", "build_lm", "lm_fields",
    "lm_flops", "remat_policy", "resolve_attention", "resolve_size", "rms_norm",
]

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION = ("auto", "xla", "cudnn")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


LM_SIZES: dict[str, TransformerSize] = {
    "tiny": TransformerSize(32, 2, 2, 64),
    "small": TransformerSize(256, 4, 4, 704),
    "124m": TransformerSize(768, 12, 12, 2048),
    "350m": TransformerSize(1024, 24, 16, 2816),
    "1b": TransformerSize(2048, 16, 16, 5632),
}


def remat_policy(name: str):
    """The `jax.checkpoint` policy of a REMAT_POLICIES name (None for "none")."""
    policies = jax.checkpoint_policies
    table = {"none": None, "full": policies.nothing_saveable, "dots": policies.dots_saveable,
             "dots_no_batch": policies.dots_with_no_batch_dims_saveable}
    if name not in table:
        raise ValueError(f"model.remat={name!r} is not one of {REMAT_POLICIES}")
    return table[name]


def resolve_attention(name: str, compute_dtype, head_width: int) -> str:
    """"xla" or "cudnn" for an ATTENTION name on the default backend."""
    if name not in ATTENTION:
        raise ValueError(f"model.attention={name!r} is not one of {ATTENTION}")
    fits = (jnp.dtype(compute_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_width % 8 == 0 and head_width <= 128)
    if name == "cudnn" and not (fits and jax.default_backend() == "gpu"):
        raise ValueError("model.attention='cudnn' needs a GPU, compute_dtype bfloat16 or "
                         "float16 and a head width (d_model / num_heads) a multiple of 8 up "
                         f"to 128 (here {jax.default_backend()}, "
                         f"{jnp.dtype(compute_dtype).name}, {head_width}); use 'auto'")
    if name == "auto":
        return "cudnn" if fits and jax.default_backend() == "gpu" else "xla"
    return name


def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) · scale, statistics in float32, result in x's dtype."""
    x32 = x_BxTxD.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (y * scale_D).astype(x_BxTxD.dtype)


class Block(nnx.Module):
    """Pre-RMSNorm block: causal attention with rotary positions, then a SwiGLU MLP."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, out_std: float,
                 compute_dtype, rngs: nnx.Rngs, attention: str = "xla"):
        init, out_init = nnx.initializers.normal(0.02), nnx.initializers.normal(out_std)
        key = rngs.params
        self.num_heads, self.compute_dtype = num_heads, compute_dtype
        self.attention_kernel = attention
        self.attn_norm = nnx.Param(jnp.ones((d_model,)))
        self.wq, self.wk, self.wv = (nnx.Param(init(key(), (d_model, d_model))) for _ in "qkv")
        self.wo = nnx.Param(out_init(key(), (d_model, d_model)))
        self.mlp_norm = nnx.Param(jnp.ones((d_model,)))
        self.w_gate, self.w_up = (nnx.Param(init(key(), (d_model, d_ff))) for _ in "gu")
        self.w_down = nnx.Param(out_init(key(), (d_ff, d_model)))

    def _w(self, param: nnx.Param) -> jax.Array:
        return param[...].astype(self.compute_dtype)

    def attention(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, d = x_BxTxD.shape
        heads = lambda y: y.reshape(b, t, self.num_heads, d // self.num_heads)
        q_BxTxHxK = rotary(heads(x_BxTxD @ self._w(self.wq)))
        k_BxSxHxK = rotary(heads(x_BxTxD @ self._w(self.wk)))
        v_BxSxHxK = heads(x_BxTxD @ self._w(self.wv))
        if self.attention_kernel == "cudnn":
            out_BxTxHxK = jax.nn.dot_product_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK,
                                                       is_causal=True, implementation="cudnn")
        else:
            out_BxTxHxK = causal_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK)
        return out_BxTxHxK.reshape(b, t, d) @ self._w(self.wo)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x_BxTxD = x_BxTxD + self.attention(rms_norm(x_BxTxD, self.attn_norm[...]))
        u_BxTxD = rms_norm(x_BxTxD, self.mlp_norm[...])
        gate_BxTxF = jax.nn.silu(u_BxTxD @ self._w(self.w_gate))
        return x_BxTxD + (gate_BxTxF * (u_BxTxD @ self._w(self.w_up))) @ self._w(self.w_down)


class LM(nnx.Module):
    """Token ids int32 [B, T] → next-token logits float32 [B, T, V]; L scanned blocks."""

    couples_examples = False

    def __init__(self, vocab_size: int, *, d_model: int, num_layers: int, num_heads: int, d_ff: int,
                 remat: str = "none", compute_dtype: str = "bfloat16", tie_embeddings: bool = True,
                 scan_unroll: int = 1, attention: str = "auto", rngs: nnx.Rngs):
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ValueError(f"model.num_heads={num_heads} must divide d_model={d_model} into "
                             "heads of even width (rotary positions)")
        if compute_dtype not in DTYPES:
            raise ValueError(f"model.compute_dtype={compute_dtype!r} is not one of "
                             f"{tuple(DTYPES)}")
        self.policy, self.scan_unroll = remat_policy(remat), scan_unroll
        self.num_layers = num_layers
        self.compute_dtype = dtype = DTYPES[compute_dtype]
        out_std = 0.02 / math.sqrt(2 * num_layers)
        kernel = resolve_attention(attention, dtype, d_model // num_heads)

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(d_model, num_heads, d_ff, out_std=out_std, compute_dtype=dtype,
                         rngs=rngs, attention=kernel)

        self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (vocab_size, d_model)))
        self.blocks = make_blocks(rngs)
        self.final_norm = nnx.Param(jnp.ones((d_model,)))
        self.head = (None if tie_embeddings else nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (d_model, vocab_size))))
        self.init_scheme = (f"embeddings and projections N(0, 0.02^2), residual outputs "
                            f"N(0, {out_std:.4g}^2), RMSNorm scale one")
        self.description = (f"LM(D={d_model}, L={num_layers} scanned, H={num_heads}, F={d_ff}, "
                            f"V={vocab_size}, remat={remat}, compute={compute_dtype}, "
                            f"attention={kernel}, {'tied' if tie_embeddings else 'untied'})")

    def __call__(self, ids_BxT: jax.Array) -> jax.Array:
        h_BxTxD = jnp.take(self.embed[...], ids_BxT, axis=0).astype(self.compute_dtype)

        body = lambda block, h: block(h)
        if self.policy is not None:
            body = nnx.remat(body, policy=self.policy, prevent_cse=False)
        run = nnx.scan(lambda h, block: body(block, h), in_axes=(nnx.Carry, 0),
                       out_axes=nnx.Carry, unroll=self.scan_unroll)
        h_BxTxD = rms_norm(run(h_BxTxD, self.blocks), self.final_norm[...])
        head_DxV = self.embed[...].T if self.head is None else self.head[...]
        # Logits in the compute dtype (accumulated in float32), widened for the loss: a float32
        # output would make both backward [B·T, V] matmuls float32 (17 % of the 124m step, H200).
        logits_BxTxV = jnp.einsum("btd,dv->btv", h_BxTxD, head_DxV.astype(self.compute_dtype),
                                  preferred_element_type=self.compute_dtype)
        return logits_BxTxV.astype(jnp.float32)


def lm_fields() -> ml_collections.ConfigDict:
    """The `model` fields of "lm"."""
    c = ml_collections.ConfigDict()
    c.size = "tiny"  # row of cbs.models.lm.LM_SIZES: tiny | small | 124m | 350m | 1b
    c.d_model = 0  # model width D; 0 = from size
    c.num_layers = 0  # number of (scanned) blocks L; 0 = from size
    c.num_heads = 0  # attention heads H (D/H even); 0 = from size
    c.d_ff = 0  # SwiGLU hidden width F; 0 = from size
    c.remat = "none"  # rematerialisation of each block: none | full | dots | dots_no_batch
    c.compute_dtype = "bfloat16"  # matmul/activation dtype; params stay float32
    c.tie_embeddings = True  # output head = embedding^T
    c.scan_unroll = 1  # nnx.scan unroll over the layers (1 = rolled, one copy of the block)
    c.attention = "auto"  # attention kernel: auto (cuDNN flash on a GPU, else xla) | xla | cudnn
    return c


def resolve_size(c: ml_collections.ConfigDict) -> TransformerSize:
    """The (d_model, num_layers, num_heads, d_ff) that config `c` asks for."""
    return resolve_row(c, LM_SIZES)


def lm_flops(c: ml_collections.ConfigDict, inputs: ModelInputs) -> float:
    """Training FLOPs of one sequence of T = inputs.input_shape[-1] tokens."""
    s = resolve_size(c)
    seq_len = int(inputs.input_shape[-1]) if inputs.input_shape else 0
    return seq_len * lm_flops_per_token(s.d_model, s.num_layers, s.d_ff,
                                        inputs.vocab_size or 0, seq_len)


@register("lm", default_config=lm_fields, flops=lm_flops)
def build_lm(c: ml_collections.ConfigDict, inputs: ModelInputs, rngs: nnx.Rngs) -> LM:
    if inputs.vocab_size is None:
        raise ValueError("model.name='lm' needs vocab_size (a dataset with a vocabulary)")
    s = resolve_size(c)
    check_positive(c, "scan_unroll")
    return LM(inputs.vocab_size, **dataclasses.asdict(s), remat=c.remat,
              compute_dtype=c.compute_dtype, tie_embeddings=c.tie_embeddings,
              scan_unroll=c.scan_unroll, attention=c.attention, rngs=rngs)
