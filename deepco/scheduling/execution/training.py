"""What every executed job trains: a small CNN on scikit-learn's handwritten digits, in numpy.

The digits (1797 8x8 images, 10 classes) ship inside scikit-learn, so nothing is downloaded. The network is
conv 3x3 (8 filters, padding 1) -> ReLU -> 2x2 max-pool -> fully connected (128 -> 10) -> softmax, trained
with plain SGD on the parameter server; a worker computes one mini-batch's loss and gradients.
numpy keeps the Ray processes light (no torch import per actor); ``tests`` check the gradients against
torch's autograd.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

Params = dict[str, np.ndarray]
FILTERS = 8
TEST_FRACTION = 1 / 6  # held-out images the PS evaluates the loss on


@lru_cache(maxsize=1)
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): images as float32 N x 8 x 8 in [0, 1], one fixed shuffle."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # the [ray] extra brings it
        from deepco.errors import UserError

        raise UserError("executing schedules needs scikit-learn (its digits are the training data): "
                        "pip install 'deepco[ray]'") from None
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    n_test = int(len(y) * TEST_FRACTION)
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def init_params(seed: int) -> Params:
    """He-initialised weights; the seed makes each job's start reproducible."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((FILTERS, 9)) * np.sqrt(2 / 9)).astype(np.float32),
        "b1": np.zeros(FILTERS, np.float32),
        "w2": (rng.standard_normal((FILTERS * 16, 10)) * np.sqrt(2 / (FILTERS * 16))).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def _patches(x: np.ndarray) -> np.ndarray:
    """B x 8 x 8 images -> B x 64 x 9: the 3x3 neighbourhood (zero padded) of every pixel."""
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1)))
    win = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(1, 2))  # B x 8 x 8 x 3 x 3
    return win.reshape(len(x), 64, 9)


def _forward(params: Params, x: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    b = len(x)
    cols = _patches(x)
    z = cols @ params["w1"].T + params["b1"]  # B x 64 x C, pixels in row-major order
    a = np.maximum(z, 0.0).reshape(b, 8, 8, FILTERS)
    # 2x2 windows as the last axis: B x 4 x 4 x C x 4
    win = a.reshape(b, 4, 2, 4, 2, FILTERS).transpose(0, 1, 3, 5, 2, 4).reshape(b, 4, 4, FILTERS, 4)
    arg = win.argmax(axis=-1)
    h = np.take_along_axis(win, arg[..., None], axis=-1)[..., 0].reshape(b, -1)  # B x 128
    logits = h @ params["w2"] + params["b2"]
    return logits, {"cols": cols, "z": z, "arg": arg, "h": h}


def _softmax_loss(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean()), np.exp(logp)


def loss_and_grads(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
    """Mean cross-entropy of one mini-batch and its gradient for every parameter."""
    b = len(x)
    logits, cache = _forward(params, x)
    loss, prob = _softmax_loss(logits, y)
    dlogits = prob
    dlogits[np.arange(b), y] -= 1.0
    dlogits /= b
    grads = {"w2": cache["h"].T @ dlogits, "b2": dlogits.sum(axis=0)}
    dh = (dlogits @ params["w2"].T).reshape(b, 4, 4, FILTERS)
    dwin = np.zeros((b, 4, 4, FILTERS, 4), np.float32)
    np.put_along_axis(dwin, cache["arg"][..., None], dh[..., None], axis=-1)
    da = dwin.reshape(b, 4, 4, FILTERS, 2, 2).transpose(0, 1, 4, 2, 5, 3).reshape(b, 64, FILTERS)
    dz = da * (cache["z"] > 0)
    grads["w1"] = np.einsum("bpc,bpk->ck", dz, cache["cols"])
    grads["b1"] = dz.sum(axis=(0, 1))
    return loss, {k: v.astype(np.float32) for k, v in grads.items()}


def evaluate(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on a labelled set."""
    logits, _ = _forward(params, x)
    loss, prob = _softmax_loss(logits, y)
    return loss, float((prob.argmax(axis=1) == y).mean())


def sgd(params: Params, grads: Params, lr: float) -> None:
    """One SGD update, in place (the PS applies each worker's push this way)."""
    for k, g in grads.items():
        params[k] -= lr * g
