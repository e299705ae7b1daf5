"""Synthetic problems with known answers: Gaussian linear regression and teacher-student.

Linear regression (letters: D features, C input covariance, w* teacher weights, σ label
noise, δ = w − w*): x ~ N(0, C), y = x·w* + σε, per-example loss ℓ = ½(x·w − y)².
At any w the population quantities are (Isserlis' theorem for Gaussian x):
  G = Cδ,   H = C,   Σ = Cδδᵀ C + (δᵀCδ + σ²) C,
  tr(Σ) = (δᵀCδ + σ²)·tr C + |Cδ|²,   tr(HΣ) = (δᵀCδ + σ²)·tr C² + δᵀC³δ,
  GᵀHG = δᵀC³δ,   L = ½(δᵀCδ + σ²),
so B_simple = tr(Σ)/|G|² and B_noise = tr(HΣ)/GᵀHG are known in closed form
(McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", Sec. 2 and App. A).
`linreg_noise_stats` evaluates them in float64.

Teacher-student classification and regression: x ~ N(0, I_D), labels from a fixed random
one-hidden-layer tanh teacher (`teacher_student`, `teacher_regression`).
"""

from __future__ import annotations

import numpy as np

from cbs.data.dataset import ClassificationView, Dataset, RegressionView, Split

# and `linreg_noise_stats`, public as cbs.data.linreg_noise_stats
__all__ = ["linreg", "teacher_regression", "teacher_student"]


def linreg_noise_stats(w, *, cov, w_star, noise_std: float) -> dict[str, np.ndarray | float]:
    """Population noise statistics of Gaussian linear regression at weights `w` (float64):
    grad [D] (= G), loss, grad_sq_norm (|G|²), trace_sigma (tr Σ), trace_h_sigma (tr HΣ),
    g_h_g (GᵀHG), b_simple and b_noise."""
    cov = np.asarray(cov, np.float64)
    delta = np.asarray(w, np.float64) - np.asarray(w_star, np.float64)
    c_delta = cov @ delta
    quad = float(delta @ c_delta)  # δᵀCδ
    g_h_g = float(c_delta @ cov @ c_delta)  # δᵀC³δ
    grad_sq_norm = float(c_delta @ c_delta)
    scale = quad + noise_std**2
    trace_sigma = scale * float(np.trace(cov)) + grad_sq_norm
    trace_h_sigma = scale * float(np.sum(cov * cov.T)) + g_h_g
    return {"grad": c_delta, "loss": 0.5 * scale, "grad_sq_norm": grad_sq_norm,
            "trace_sigma": trace_sigma, "trace_h_sigma": trace_h_sigma, "g_h_g": g_h_g,
            "b_simple": trace_sigma / grad_sq_norm if grad_sq_norm > 0 else np.inf,
            "b_noise": trace_h_sigma / g_h_g if g_h_g > 0 else np.inf}


def linreg(*, dim: int = 16, num_train: int = 8192, num_eval: int = 2048,
           noise_std: float = 0.5, cov_decay: float = 1.0, rotate: bool = False,
           data_seed: int = 0) -> Dataset:
    """Gaussian linear regression: x float32 [N, dim], y float32 [N]. Covariance eigenvalues
    (1 + k)^(-cov_decay), k = 0..dim-1, in a random basis if `rotate`; w* ~ N(0, I/dim).
    metadata holds cov, w_star, noise_std and `noise_stats(w)`, the closed-form population
    statistics at w (`linreg_noise_stats`)."""
    if dim < 1 or num_train < 2 or num_eval < 1:
        raise ValueError(f"need dim >= 1, num_train >= 2, num_eval >= 1; got {dim}, "
                         f"{num_train}, {num_eval}")
    rng = np.random.default_rng(data_seed)
    eig = (1.0 + np.arange(dim)) ** (-float(cov_decay))
    basis = np.linalg.qr(rng.normal(size=(dim, dim)))[0] if rotate else np.eye(dim)
    cov = (basis * eig) @ basis.T
    sqrt_cov = basis * np.sqrt(eig)  # x = sqrt_cov @ z has covariance cov
    w_star = rng.normal(size=dim) / np.sqrt(dim)

    def sample(n):
        x = rng.normal(size=(n, dim)) @ sqrt_cov.T
        y = x @ w_star + noise_std * rng.normal(size=n)
        return {"x": x.astype(np.float32), "y": y.astype(np.float32)}

    view = RegressionView()
    splits = {"train": Split(num_train, view, sample(num_train)),
              "eval": Split(num_eval, view, sample(num_eval))}
    stats = lambda w: linreg_noise_stats(w, cov=cov, w_star=w_star, noise_std=noise_std)
    meta = {"cov": cov, "w_star": w_star, "noise_std": float(noise_std), "noise_stats": stats}
    return Dataset(name="linreg", task="regression", input_shape=(dim,), splits=splits,
                   metadata=meta)


def teacher_student(*, dim: int = 32, hidden: int = 64, num_classes: int = 10,
                    num_train: int = 8192, num_eval: int = 2048, temperature: float = 0.0,
                    one_hot: bool = False, data_seed: int = 0) -> Dataset:
    """Teacher-student classification: x float32 [N, dim] ~ N(0, I), y int32 [N]. Teacher
    logits = tanh(x W1) W2 with W1 ~ N(0, 1/dim), W2 ~ N(0, 4/hidden) (so logits are O(1)
    apart); labels are argmax (temperature 0) or softmax samples (label noise). metadata holds
    the teacher weights and the fraction of labels equal to the argmax."""
    if num_classes < 2 or temperature < 0:
        raise ValueError(f"need num_classes >= 2 and temperature >= 0; got {num_classes}, "
                         f"{temperature}")
    rng = np.random.default_rng(data_seed)
    w1 = rng.normal(size=(dim, hidden)) / np.sqrt(dim)
    w2 = rng.normal(size=(hidden, num_classes)) * 2.0 / np.sqrt(hidden)

    def sample(n):
        x = rng.normal(size=(n, dim))
        logits = np.tanh(x @ w1) @ w2
        if temperature == 0:
            y = logits.argmax(-1)
        else:
            gumbel = -np.log(-np.log(rng.uniform(size=logits.shape)))
            y = (logits / temperature + gumbel).argmax(-1)
        return {"x": x.astype(np.float32), "y": y.astype(np.int32)}, logits.argmax(-1)

    (train, train_best), (eval_, _) = sample(num_train), sample(num_eval)
    view = ClassificationView(num_classes=num_classes, one_hot=one_hot)
    splits = {"train": Split(num_train, view, train), "eval": Split(num_eval, view, eval_)}
    meta = {"w1": w1, "w2": w2, "temperature": float(temperature),
            "train_argmax_agreement": float(np.mean(train["y"] == train_best))}
    return Dataset(name="teacher_student", task="classification", input_shape=(dim,),
                   splits=splits, num_classes=num_classes, metadata=meta)


def teacher_regression(*, dim: int = 16, hidden: int = 32, num_train: int = 8192,
                       num_eval: int = 2048, noise_std: float = 0.1, data_seed: int = 0) -> Dataset:
    """Teacher-student regression: x float32 [N, dim] ~ N(0, I), y float32 [N], per-example
    loss ½(ŷ − y)². f(x) = tanh(x W1) w2 / s with W1 ~ N(0, 4/dim) (so the tanh units saturate
    and f is far from linear), w2 ~ N(0, 1/hidden), s the standard deviation of tanh(x W1) w2
    over 65,536 draws of x (Var f ≈ 1); y = f(x) + noise_std·ε. metadata holds the teacher and
    `loss_floor` = noise_std²/2, the expected loss of f itself."""
    if dim < 1 or hidden < 1 or num_train < 2 or num_eval < 1 or noise_std < 0:
        raise ValueError(f"need dim, hidden >= 1, num_train >= 2, num_eval >= 1 and "
                         f"noise_std >= 0; got {dim}, {hidden}, {num_train}, {num_eval}, "
                         f"{noise_std}")
    rng = np.random.default_rng(data_seed)
    w1 = rng.normal(size=(dim, hidden)) * 2.0 / np.sqrt(dim)
    w2 = rng.normal(size=hidden) / np.sqrt(hidden)
    scale = float(np.std(np.tanh(rng.normal(size=(65_536, dim)) @ w1) @ w2))

    def sample(n):
        x = rng.normal(size=(n, dim))
        y = np.tanh(x @ w1) @ w2 / scale + noise_std * rng.normal(size=n)
        return {"x": x.astype(np.float32), "y": y.astype(np.float32)}

    view = RegressionView()
    splits = {"train": Split(num_train, view, sample(num_train)),
              "eval": Split(num_eval, view, sample(num_eval))}
    meta = {"w1": w1, "w2": w2, "scale": scale, "noise_std": float(noise_std),
            "loss_floor": 0.5 * float(noise_std) ** 2}
    return Dataset(name="teacher_regression", task="regression", input_shape=(dim,),
                   splits=splits, metadata=meta)
