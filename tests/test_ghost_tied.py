"""cbs.stats.ghost_tied: a params leaf read by several `dot_general` / embedding `gather` uses
(a tied input/output embedding, a kernel read by two matmuls in the same or the transposed
layout, inside `lax.scan`) gets its per-example squared norms from the Gram terms of its uses
or from its per-example gradients in the leaf's layout, whichever is cheaper: both equal the
vmap reference in float64, the summed gradient equals the ordinary one, and a leaf read in any
other combination (a convolution and a matmul, two matmuls sharing its axes only in part)
still takes the materialised path. The LMs of `cbs.models` with tied embeddings take the rule;
a bfloat16 LM's norms are within bfloat16 rounding of the float32 reference and its ghost pass
forms no [B, V, D] tensor."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cbs import models
from cbs.models import lm
from cbs.stats import ghost, ghost_tied, nested

B, T, V, D = 5, 6, 11, 4


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))


def _normal(key, shape, scale=0.5):
    return scale * jax.random.normal(key, shape, jnp.float64)


# ----------------------------------------------------------------------------- toy models


def tied_embedding():
    """Embedding table E [V, D] read by its gather and by the output head h @ Eᵀ."""
    k = _keys(3)
    params = {"embed": _normal(k[0], (V, D)), "mix": _normal(k[1], (D, D))}

    def loss_fn(p, b):
        h = jnp.tanh(p["embed"][b["ids"]] @ p["mix"])
        return _xent(h @ p["embed"].T, b["y"])

    ids = jax.random.randint(k[2], (B, T), 0, V)
    return loss_fn, params, {"ids": ids, "y": (ids * 3 + 1) % V}, {"embed": "tied"}


def dense_same():
    """A kernel W [4, 5] read by two matmuls in the same layout (x @ W, then z @ W)."""
    k = _keys(3, 1)
    params = {"w": _normal(k[0], (4, 5)), "m": _normal(k[1], (5, 4))}

    def loss_fn(p, b):
        a = jnp.tanh(b["x"] @ p["w"])
        return jnp.mean(jnp.square(jnp.tanh(a @ p["m"]) @ p["w"] - 0.2))

    return loss_fn, params, {"x": _normal(k[2], (B, T, 4), 1.0)}, {"w": "tied"}


def dense_transposed():
    """A kernel W [4, 5] read as x @ W and, transposed, as y @ Wᵀ (W on the lhs of the
    second `dot_general`, as `einsum("od,btd->bto")` puts it)."""
    k = _keys(2, 2)
    params = {"w": _normal(k[0], (4, 5))}

    def loss_fn(p, b):
        a = jnp.tanh(b["x"] @ p["w"])  # [B, T, 5]
        y = jnp.einsum("od,btd->bto", p["w"], a)  # W [4, 5] on the lhs: a @ Wᵀ
        return jnp.mean(jnp.square(jnp.tanh(y) - 0.1))

    return loss_fn, params, {"x": _normal(k[1], (B, T, 4), 1.0)}, {"w": "tied"}


def dense_three_axes():
    """W [2, 3, 5] read three times: contracting (k, c) in that order, in the order (c, k)
    (the same layout with its features permuted), and transposed (its free axis contracted)."""
    k = _keys(3, 3)
    params = {"w": _normal(k[0], (2, 3, 5))}

    def loss_fn(p, b):
        a = jnp.tanh(jnp.einsum("btkc,kco->bto", b["x"], p["w"]))  # [B, T, 5]
        z = jnp.tanh(jnp.einsum("bto,kco->btck", a, p["w"]))  # [B, T, 3, 2]
        y = jnp.einsum("btck,kco->bto", z, p["w"])
        return jnp.mean(jnp.square(y - 0.1))

    return loss_fn, params, {"x": _normal(k[1], (B, T, 2, 3), 1.0)}, {"w": "tied"}


def gather_and_onehot():
    """A table E [V, D] read by a gather of one id stream and, as one-hot rows times E, by a
    second stream; and a second table read by two gathers (two streams of ids)."""
    k = _keys(4, 4)
    params = {"e": _normal(k[0], (V, D)), "pos": _normal(k[1], (V, D))}

    def loss_fn(p, b):
        h = p["e"][b["ids"]] + jax.nn.one_hot(b["other"], V, dtype=jnp.float64) @ p["e"]
        h = h * p["pos"][b["ids"]] + jnp.tanh(p["pos"][b["other"]])
        return jnp.mean(jnp.square(jnp.tanh(h) - 0.3))

    ids = jax.random.randint(k[2], (B, T), 0, V)
    other = jax.random.randint(k[3], (B, T), 0, V)
    return loss_fn, params, {"ids": ids, "other": other}, {"e": "tied", "pos": "tied"}


def scanned_pairs():
    """Stacked kernels [L, 4, 4] read twice per `lax.scan` step (h @ w, then h @ wᵀ)."""
    k = _keys(2, 5)
    params = {"stack": _normal(k[0], (3, 4, 4))}

    def loss_fn(p, b):
        def body(h, w):
            return jnp.tanh(jnp.tanh(h @ w) @ w.T), None

        h, _ = jax.lax.scan(body, b["x"], p["stack"])
        return jnp.mean(jnp.square(h - 0.1))

    return loss_fn, params, {"x": _normal(k[1], (B, T, 4), 1.0)}, {"stack": "tied"}


def fallbacks():
    """Leaves the rule leaves to the materialised path: a kernel read by a 1×1 convolution
    and a matmul; one read by two matmuls whose contracted axes overlap in part."""
    k = _keys(3, 6)
    params = {"conv_dot": _normal(k[0], (3, 3)), "overlap": _normal(k[1], (2, 3, 4))}

    def loss_fn(p, b):
        c = jax.lax.conv_general_dilated(b["img"], p["conv_dot"][None, None], (1, 1), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jnp.tanh(c.reshape(c.shape[0], -1, 3)) @ p["conv_dot"]  # [B, 16, 3]
        x1 = jnp.concatenate([h[:, :, None], jnp.sin(h)[:, :, None]], 2)  # [B, 16, 2, 3]
        a = jnp.tanh(jnp.einsum("btkc,kcd->btd", x1, p["overlap"]))  # contracts axes (0, 1)
        x2 = jnp.concatenate([a[:, :, None], -a[:, :, None]], 2)  # [B, 16, 2, 4]
        y = jnp.einsum("btkd,kcd->btc", x2, p["overlap"])  # contracts axes (0, 2)
        return jnp.mean(jnp.square(y - 0.1))

    img = _normal(k[2], (B, 4, 4, 3), 1.0)
    return loss_fn, params, {"img": img}, {"conv_dot": "materialised",
                                           "overlap": "materialised"}


TOYS = {"tied_embedding": tied_embedding, "dense_same": dense_same,
        "dense_transposed": dense_transposed, "dense_three_axes": dense_three_axes,
        "gather_and_onehot": gather_and_onehot, "scanned_pairs": scanned_pairs,
        "fallbacks": fallbacks}


def paths_taken(loss_fn, params, batch) -> dict[str, str]:
    """Per params path, the rule its norms take (`ghost.leaf_rules`)."""
    return ghost.leaf_rules(loss_fn, params, batch)


def _info(loss_fn, method):
    return jax.jit(functools.partial(ghost.per_example_grads_info, loss_fn, method=method))


def _check(loss_fn, params, batch, rtol=1e-10):
    """Fast norms and gradient against the vmap reference and the ordinary gradient."""
    loss, grad, sq = _info(loss_fn, "fast")(params, batch)
    ref_loss, ref_grad, ref_sq = _info(loss_fn, "vmap")(params, batch)
    plain = jax.grad(loss_fn)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
    for name in ref_sq:
        scale = float(jnp.max(jnp.abs(plain[name])))
        np.testing.assert_allclose(grad[name], plain[name], rtol=rtol, atol=rtol * scale)
        np.testing.assert_allclose(grad[name], ref_grad[name], rtol=rtol, atol=rtol * scale)
        np.testing.assert_allclose(sq[name], ref_sq[name], rtol=rtol)
        assert len(set(np.asarray(sq[name]).tolist())) == len(sq[name])  # each its own


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("form", ["auto", "gram", "direct"])
@pytest.mark.parametrize("name", sorted(TOYS))
def test_toy_leaves_equal_the_reference_in_float64(x64, monkeypatch, name, form):
    """Each toy leaf takes the rule it should (the Gram or the direct form, forced or the
    cheaper one) or the materialised path, and its norms and gradient are exact."""
    monkeypatch.setattr(ghost_tied, "FORM", form)
    loss_fn, params, batch, expected = TOYS[name]()
    taken = paths_taken(loss_fn, params, batch)
    for path, kind in expected.items():
        if kind == "tied":
            want = {f"tied {form}"} if form != "auto" else {"tied gram", "tied direct"}
            assert taken[path] in want, (path, taken)
        else:
            assert taken[path] == kind, (path, taken)
    _check(loss_fn, params, batch)


@pytest.mark.parametrize("form", ["gram", "direct"])
def test_chunks_of_examples(x64, monkeypatch, form):
    """Both forms in padded chunks of 2 of the 5 examples (the direct form's gradient summed
    chunk by chunk, the padding left out) equal the whole batch at once."""
    monkeypatch.setattr(ghost_tied, "FORM", form)
    for model in (tied_embedding, scanned_pairs):
        loss_fn, params, batch, _ = model()
        whole = _info(loss_fn, "fast")(params, batch)
        chunked = jax.jit(functools.partial(ghost.per_example_grads_info, loss_fn,
                                            method="fast", chunk_size=2))(params, batch)
        for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("v,d,t,form", [
    (50304, 768, 64, "gram"), (50304, 768, 128, "direct"),  # 124m's table
    (8192, 32, 16, "gram"), (8192, 32, 32, "direct"),  # docs/guides/benchmarks.md
])
def test_forms_by_cost(v, d, t, form):
    """auto takes the Gram form where its T² terms cost less than the memory traffic of the
    per-example gradients in the direct form (whose products replace the weight gradient)."""
    gather = ghost_tied.Part(None, "gather", (0,), (1,), (v,), (d,), t)
    head = ghost_tied.Part(None, "dot", (1,), (0,), (d,), (v,), t)
    gram = (ghost_tied._pair_cost(gather, gather) + ghost_tied._pair_cost(gather, head)
            + ghost_tied._pair_cost(head, head))
    direct = ghost_tied._direct_cost((gather, head), v * d)
    assert ("gram" if gram < direct else "direct") == form, (gram, direct)


def test_materialised_form_is_kept_for_the_benchmark(x64, monkeypatch):
    """FORM = "materialised" keeps the path from before the rule (benchmarks/lm_step.py)."""
    monkeypatch.setattr(ghost_tied, "FORM", "materialised")
    loss_fn, params, batch, _ = tied_embedding()
    assert paths_taken(loss_fn, params, batch)["embed"] == "materialised"
    _check(loss_fn, params, batch)
    monkeypatch.setattr(ghost_tied, "FORM", "fastest")
    with pytest.raises(ValueError, match="FORM must be one of"):
        ghost._plan(loss_fn, params, batch)


# ----------------------------------------------------------------------------- cbs models


def _cbs_lm(name, vocab=V, **fields):
    mc = models.default_model_config(name)
    mc.update(**fields)
    model = models.build_model(mc, input_shape=(T,), vocab_size=vocab, rngs=nnx.Rngs(0),
                               verbose=False)
    graphdef, params, rest = models.split_model(model)
    ids = jax.random.randint(_keys(1, 7)[0], (B, T + 1), 0, vocab)
    return models.make_loss_fn(graphdef, rest, "lm"), params, {"x": ids[:, :-1],
                                                               "y": ids[:, 1:]}


def _tied_leaf(params) -> int:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    return next(i for i, p in enumerate(paths) if "embed" in p)


@pytest.mark.parametrize("form", ["gram", "direct"])
@pytest.mark.parametrize("name", ["transformer", "lm"])
def test_cbs_tied_lms_equal_the_reference(x64, monkeypatch, name, form):
    """The tied embedding of the Transformer LM (`model.tie_embeddings=True`) and of the scanned
    LM takes the rule, and every norm and gradient equals the vmap reference. Both models are
    built in float64 (the scanned LM with a float64 compute dtype), but take their attention
    scores (and the scanned LM its norm statistics) in float32 whatever their dtype, so the
    two agree to float32 rounding here; the toy models above are the float64 check."""
    monkeypatch.setattr(ghost_tied, "FORM", form)
    if name == "lm":
        monkeypatch.setitem(lm.DTYPES, "float64", jnp.float64)
        loss_fn, params, batch = _cbs_lm("lm", compute_dtype="float64", attention="xla")
    else:
        loss_fn, params, batch = _cbs_lm("transformer", tie_embeddings=True)
    params = jax.tree.map(lambda x: x.astype(jnp.float64), params)
    leaf = _tied_leaf(params)
    assert ghost._plan(loss_fn, params, batch).tied[leaf].form == form
    assert ghost.uncovered_leaves(loss_fn, params, batch) == {}
    fast = _info(loss_fn, "fast")(params, batch)
    ref = _info(loss_fn, "vmap")(params, batch)
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def _shapes(jaxpr):
    """Every intermediate shape of a jaxpr, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for sub in nested.sub_jaxprs(eqn):
            yield from _shapes(sub)


def _has_per_example_table(shapes, v, d) -> bool:
    return any(len(s) >= 3 and tuple(s[-2:]) in ((v, d), (d, v)) for s in shapes)


def _f32_vocabulary_matmuls(text: str, v: int) -> list[str]:
    """Operand types of the program's float32 matmuls with a vocabulary axis."""
    operands = [re.search(r":\s*\((.*?)\)\s*->", line)[1] for line in text.splitlines()
                if "stablehlo.dot_general" in line]
    return [o for o in operands if f"x{v}x" in o.replace(">", "x") and o.count("xf32>") == 2]


def test_bf16_lm_within_bf16_rounding_and_no_per_example_table(monkeypatch):
    """The scanned LM computing in bfloat16 (float32 parameters): its tied embedding takes the
    Gram form, its norms (and those of the direct form) are within bfloat16 rounding of the
    float32 model's vmap reference, and no array of its ghost pass has the table's [V, D] as
    trailing axes beyond the table itself, nor a float32 matmul on the vocabulary axis (the
    materialised path has both)."""
    vocab = 97  # T² terms cheaper than the [V, D] per-example gradients: the Gram form
    loss_fn, params, batch = _cbs_lm("lm", vocab, compute_dtype="bfloat16")
    loss32, _, _ = _cbs_lm("lm", vocab, compute_dtype="float32")
    leaf = _tied_leaf(params)
    d = jax.tree.leaves(params)[leaf].shape[1]
    plan = ghost._plan(loss_fn, params, batch)
    assert plan.tied[leaf].form == "gram"
    _, ref_grad, ref_sq = _info(loss32, "vmap")(params, batch)
    for form in ("gram", "direct"):  # auto's, and the other with bfloat16 products too
        monkeypatch.setattr(ghost_tied, "FORM", form)
        _, grad, sq = _info(loss_fn, "fast")(params, batch)
        for a, b in zip(jax.tree.leaves(sq), jax.tree.leaves(ref_sq), strict=True):
            assert a.dtype == jnp.float32
            np.testing.assert_allclose(a, b, rtol=0.02)  # 0.6 % at most
        for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
            np.testing.assert_allclose(a, b, atol=0.03 * float(jnp.max(jnp.abs(b))))
    monkeypatch.setattr(ghost_tied, "FORM", "auto")
    fresh = lambda: functools.partial(ghost.per_example_grads_info, loss_fn, method="fast")
    shapes = lambda: _shapes(jax.make_jaxpr(fresh())(params, batch).jaxpr)  # traced anew
    assert not _has_per_example_table(shapes(), vocab, d)
    assert not _f32_vocabulary_matmuls(jax.jit(fresh()).lower(params, batch).as_text(), vocab)
    monkeypatch.setattr(ghost_tied, "FORM", "materialised")
    assert _has_per_example_table(shapes(), vocab, d)
    assert _f32_vocabulary_matmuls(jax.jit(fresh()).lower(params, batch).as_text(), vocab)
