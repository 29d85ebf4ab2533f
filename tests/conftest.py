import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HYDRA_FULL_ERROR", "0")


def assert_close(actual, expected, rtol, atol=0.0, what=""):
    """Compare in float64 and report the worst relative error."""
    import torch
    actual, expected = actual.double(), expected.double()
    err = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    worst = (err / (expected.abs() + 1e-30)).max().item()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert (err <= bound).all(), f"{what}: max abs err {err.max().item():.3e}, worst rel {worst:.3e}"
