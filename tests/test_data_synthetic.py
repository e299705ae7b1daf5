"""cbs.data.synthetic: closed-form linear-regression noise statistics and teacher-student."""

import numpy as np
import pytest

import cbs.data as data
from cbs.data.batching import host_batch


def _within(estimate: float, truth: float, samples: np.ndarray, k: float = 5.0) -> None:
    se = samples.std() / np.sqrt(len(samples))
    assert abs(estimate - truth) < k * se, (estimate, truth, se)


@pytest.mark.parametrize("where", ["zero", "near"])
def test_linreg_closed_form_matches_monte_carlo(where):
    # Per-example gradients g_i = x_i (x_i·w − y_i) over 200,000 draws, in float64.
    ds = data.get_dataset("linreg", dim=4, num_train=200_000, num_eval=10, rotate=True,
                          noise_std=0.3, cov_decay=1.5, data_seed=1)
    meta = ds.metadata
    w = np.zeros(4) if where == "zero" else meta["w_star"] + 0.2 * np.array([1, -1, 0.5, 2])
    truth = meta["noise_stats"](w)
    x, y = ds.train["x"].astype(np.float64), ds.train["y"].astype(np.float64)
    residual = x @ w - y
    g = x * residual[:, None]
    for j in range(4):
        _within(g[:, j].mean(), truth["grad"][j], g[:, j])
    _within(np.mean(0.5 * residual**2), truth["loss"], 0.5 * residual**2)
    centred = g - truth["grad"]
    _within(np.sum(centred**2) / len(g), truth["trace_sigma"], np.sum(centred**2, 1))
    h_quad = np.einsum("bi,ij,bj->b", centred, meta["cov"], centred)
    _within(h_quad.mean(), truth["trace_h_sigma"], h_quad)
    grad = truth["grad"]
    assert truth["g_h_g"] == pytest.approx(grad @ meta["cov"] @ grad, rel=1e-12)
    assert truth["b_simple"] == pytest.approx(truth["trace_sigma"] / (grad @ grad), rel=1e-12)
    assert truth["b_noise"] == pytest.approx(truth["trace_h_sigma"] / truth["g_h_g"], rel=1e-12)


def test_linreg_shapes_and_known_values():
    ds = data.get_dataset("linreg", dim=3, num_train=64, num_eval=8, cov_decay=0.0,
                          noise_std=0.5)
    assert (ds.task, ds.input_shape, ds.num_train, ds.num_eval) == ("regression", (3,), 64, 8)
    batch = host_batch(ds, 0, 16, seed=0)
    assert batch["x"].shape == (16, 3) and batch["y"].shape == (16,)
    assert batch["x"].dtype == batch["y"].dtype == np.float32
    # C = I, w = w* + e_0: G = e_0, tr Σ = (1 + σ²)·3 + 1, tr HΣ the same, GᵀHG = 1.
    stats = data.linreg_noise_stats(ds.metadata["w_star"] + np.eye(3)[0], cov=np.eye(3),
                                    w_star=ds.metadata["w_star"], noise_std=0.5)
    assert stats["trace_sigma"] == pytest.approx(1.25 * 3 + 1)
    assert stats["trace_h_sigma"] == pytest.approx(1.25 * 3 + 1)
    assert (stats["grad_sq_norm"], stats["g_h_g"]) == (1.0, 1.0)
    at_optimum = data.linreg_noise_stats(np.zeros(3), cov=np.eye(3), w_star=np.zeros(3),
                                         noise_std=0.5)
    assert at_optimum["b_simple"] == np.inf


def test_teacher_student_labels():
    ds = data.get_dataset("teacher_student", dim=8, hidden=16, num_classes=5, num_train=2000,
                          num_eval=100)
    assert (ds.task, ds.input_shape, ds.num_classes) == ("classification", (8,), 5)
    assert ds.train["y"].dtype == np.int32 and set(np.unique(ds.train["y"])) == set(range(5))
    assert ds.metadata["train_argmax_agreement"] == 1.0
    again = data.get_dataset("teacher_student", dim=8, hidden=16, num_classes=5,
                             num_train=2000, num_eval=100)
    np.testing.assert_array_equal(again.train["y"], ds.train["y"])
    noisy = data.get_dataset("teacher_student", dim=8, hidden=16, num_classes=5,
                             num_train=2000, num_eval=100, temperature=1.0)
    assert 0.2 < noisy.metadata["train_argmax_agreement"] < 0.99
    with pytest.raises(ValueError, match="num_classes"):
        data.get_dataset("teacher_student", num_classes=1)


def test_teacher_regression_targets():
    """y = f(x) + σε with Var f ≈ 1 and f far from linear (a least-squares line explains
    little of it), deterministic in data_seed; the metadata's loss floor is σ²/2."""
    ds = data.get_dataset("teacher_regression", dim=16, hidden=32, num_train=8192,
                          num_eval=512, noise_std=0.1)
    assert (ds.task, ds.input_shape, ds.num_classes) == ("regression", (16,), None)
    x, y = ds.train["x"].astype(np.float64), ds.train["y"].astype(np.float64)
    assert x.dtype == np.float64 and y.shape == (8192,)
    assert 0.9 < np.var(y) < 1.15  # Var f ≈ 1 (over 8,192 draws) plus σ² = 0.01
    design = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    residual = y - design @ np.linalg.lstsq(design, y, rcond=None)[0]
    assert np.var(residual) / np.var(y) > 0.3  # a linear model leaves > 30 % unexplained
    assert ds.metadata["loss_floor"] == pytest.approx(0.005)
    again = data.get_dataset("teacher_regression", dim=16, hidden=32, num_train=8192,
                             num_eval=512, noise_std=0.1)
    np.testing.assert_array_equal(again.train["y"], ds.train["y"])
    with pytest.raises(ValueError, match="noise_std"):
        data.get_dataset("teacher_regression", noise_std=-1.0)
