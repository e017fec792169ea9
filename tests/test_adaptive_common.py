"""What every adaptive clip does alike: the C++ walk and the pairs form, state_dict round trips, argument
checks, the optimizer hook, the docs' example and CUDA steps that never wait for the device."""

import io
import math
import pathlib
import subprocess
import sys

import pytest
import torch
from testing import cuda_only, gradient_run, model_pair, set_grads

import torchclip
from torchclip.adaptive import ClipGradByQuantile, ClipGradByUnitwiseNorm, ClipGradByZScore


@pytest.mark.parametrize(
    "make_clip",
    [
        lambda: ClipGradByQuantile(0.5, 4, global_threshold=True),
        lambda: ClipGradByZScore(warmup_steps=4, z_thresh=1.5),
    ],
    ids=["quantile-global", "zscore"],
)
def test_the_walk_agrees_with_the_pairs_form(make_clip):
    """CPU parameters take the C++ walk (the quantile: its host window's value as clip_grad_norm_'s
    max_norm; ZScore: the norms, then the host rule); Paddle's pairs take the Python walk and the
    same rules. need_clip marks leave a parameter out of both."""
    _, model = model_pair()
    _, twin = model_pair()
    torchclip.set_need_clip([next(model.parameters()), next(twin.parameters())], False)
    walked, paired = make_clip(), make_clip()
    clipped_steps = 0
    for step, grads in enumerate(gradient_run(model, 40)):
        if step == 20:
            grads[1][0] = math.inf  # an inf norm: recorded, and counted as non-finite
        set_grads(model, grads)
        set_grads(twin, grads)
        walked(model.parameters())
        paired([(p, p.grad) for p in twin.parameters()])
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=1e-9, equal_nan=True)
        assert torch.equal(next(model.parameters()).grad, grads[0])  # need_clip=False: never scaled
        clipped_steps += step < 20 and not torch.equal(list(model.parameters())[1].grad, grads[1])
        assert torch.equal(walked.last_norms, paired.last_norms)
        assert torch.equal(walked.nonfinite_steps, paired.nonfinite_steps)
    for name, value in paired.state_dict().items():
        torch.testing.assert_close(walked.state_dict()[name], value, rtol=0, atol=0, equal_nan=True)
    assert clipped_steps > 0 and walked.nonfinite_steps.item() == 1


@pytest.mark.parametrize(
    "make_clip",
    [
        lambda: ClipGradByZScore(warmup_steps=4, skip_update_on_spike=True),
        lambda: ClipGradByQuantile(0.8, 5),
        lambda: ClipGradByQuantile(0.8, 5, global_threshold=True),
        lambda: torchclip.ClipGradByNormEMA(warmup_steps=6),
        lambda: torchclip.SkipStepOnSpike(torchclip.ClipGradByGlobalNorm(3.0), window=6),
    ],
    ids=["zscore", "quantile", "quantile-global", "norm-ema", "skip-on-spike"],
)
def test_restored_mid_run_continues_bit_for_bit(make_clip):
    _, model = model_pair()
    straight, restored = make_clip(), make_clip()
    run = list(gradient_run(model, 30))
    for grads in run[:12]:
        set_grads(model, grads)
        straight(model.parameters())
    buffer = io.BytesIO()
    torch.save(straight.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    _, twin = model_pair()
    for grads in run[12:]:
        set_grads(model, grads)
        set_grads(twin, grads)
        straight(model.parameters())
        restored(twin.parameters())
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a.grad, b.grad)
        if isinstance(straight, torchclip.SkipStepOnSpike):
            assert torch.equal(straight.skip, restored.skip)


def test_state_dict_holds_tensors_only():
    for clip in (
        ClipGradByZScore(),
        ClipGradByQuantile(),
        ClipGradByQuantile(global_threshold=True),
        torchclip.ClipGradByNormEMA(),
    ):
        assert all(isinstance(v, torch.Tensor) for v in clip.state_dict().values())


@pytest.mark.parametrize(
    "make_clip,match",
    [
        (lambda: ClipGradByZScore(alpha=1.0), r"alpha must be in \(0, 1\), got 1.0"),
        (lambda: ClipGradByZScore(alpha=0), r"alpha must be in \(0, 1\), got 0"),
        (lambda: ClipGradByZScore(z_thresh=-1), "z_thresh must be a finite number > 0, got -1"),
        (lambda: ClipGradByZScore(max_grad_norm=0.0), "max_grad_norm must be a finite number > 0, got 0.0"),
        (lambda: ClipGradByZScore(eps=-1e-6), "eps must be a finite number >= 0, got -1e-06"),
        (lambda: ClipGradByZScore(warmup_steps=0), "warmup_steps must be >= 1, got 0"),
        (lambda: ClipGradByZScore(mode="zscores"), "mode must be 'zscore' or 'percentile', got 'zscores'"),
        (lambda: ClipGradByZScore(clip_option="max"), "clip_option must be 'adaptive_scaling' or 'mean', got 'max'"),
        (lambda: ClipGradByZScore(clip_factor=0), "clip_factor must be a finite number > 0, got 0"),
        (lambda: ClipGradByQuantile(quantile=1.5), r"quantile must be in \[0, 1\], got 1.5"),
        (lambda: ClipGradByQuantile(history_length=0), "history_length must be >= 1, got 0"),
        (lambda: torchclip.ClipGradByNormEMA(beta=1.0), r"beta must be in \[0, 1\), got 1.0"),
        (lambda: torchclip.ClipGradByNormEMA(lambda_rel=0), "lambda_rel must be a finite number > 0, got 0"),
        (lambda: torchclip.ClipGradByNormEMA(lambda_abs=math.inf), "lambda_abs must be a finite number > 0, got inf"),
        (lambda: torchclip.ClipGradByNormEMA(warmup_steps=-1), "warmup_steps must be >= 0, got -1"),
    ],
)
def test_bad_arguments_name_the_argument(make_clip, match):
    with pytest.raises(ValueError, match=match):
        make_clip()


@pytest.mark.parametrize(
    "make_clip,match",
    [
        (lambda: ClipGradByZScore(warmup_steps="5"), "warmup_steps must be an int, got '5'"),
        (lambda: ClipGradByQuantile(history_length=2.0), "history_length must be an int, got 2.0"),
        (lambda: ClipGradByQuantile(global_threshold=1), "global_threshold must be a bool, got 1"),
        (lambda: ClipGradByZScore(skip_update_on_spike="yes"), "skip_update_on_spike must be a bool, got 'yes'"),
    ],
)
def test_bad_argument_types_name_the_argument(make_clip, match):
    with pytest.raises(TypeError, match=match):
        make_clip()


def test_load_state_dict_refuses_a_mismatched_state_before_changing_anything():
    clip = ClipGradByZScore(warmup_steps=4)
    with pytest.raises(ValueError, match=r"warmup_norms must be a tensor of shape \(4,\), got \(25,\)"):
        clip.load_state_dict(ClipGradByZScore().state_dict())
    assert clip.steps == 0
    with pytest.raises(ValueError, match="expected the keys"):
        ClipGradByQuantile().load_state_dict(clip.state_dict())
    with pytest.raises(ValueError, match="a global clip has one history"):
        ClipGradByQuantile(history_length=1000, global_threshold=True).load_state_dict(
            {"history": torch.zeros(3, 1000, dtype=torch.float64), "counts": torch.zeros(3, dtype=torch.int64)}
        )


@pytest.mark.parametrize(
    "make_clip",
    [
        lambda: ClipGradByZScore(warmup_steps=3),
        lambda: ClipGradByQuantile(0.5, 8),
        lambda: torchclip.ClipGradByNormEMA(warmup_steps=3),
        lambda: ClipGradByUnitwiseNorm(0.05),
    ],
    ids=["zscore", "quantile", "norm-ema", "unitwise"],
)
def test_as_optimizer_hook_equals_calling_the_clip(make_clip):
    """grad_clip= on a torchclip.optim optimizer, need_clip honoured: the same steps as clip-then-step."""
    hooked_model, model = model_pair()
    for m in (hooked_model, model):
        torchclip.set_need_clip(m[0].bias, False)
    hooked = torchclip.optim.SGD(hooked_model.parameters(), lr=0.1, grad_clip=make_clip())
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    clip = make_clip()
    for grads in gradient_run(model, 12):
        set_grads(hooked_model, grads)
        set_grads(model, grads)
        hooked.step()
        clip(model.parameters())
        plain.step()
        for a, b in zip(hooked_model.parameters(), model.parameters()):
            assert torch.equal(a, b)
    assert torch.equal(hooked_model[0].bias.grad, grads[1])  # never clipped: need_clip False


def test_public_names():
    assert torchclip.ClipGradByZScore is ClipGradByZScore
    assert torchclip.ClipGradByQuantile is ClipGradByQuantile
    assert torchclip.ClipGradByUnitwiseNorm is ClipGradByUnitwiseNorm


def test_the_adaptive_pages_example_runs(tmp_path):
    section = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "adaptive.md").read_text()
    code = section[
        section.index("```python") + len("```python") : section.index("```\n", section.index("```python") + 9)
    ]
    script = tmp_path / "readme_adaptive.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert torch.load(tmp_path / "clip.pt", weights_only=True)["history"].shape == (2, 1000)


@cuda_only
@pytest.mark.parametrize(
    "make_clip",
    [
        lambda: ClipGradByZScore(warmup_steps=3),
        lambda: ClipGradByQuantile(0.9, 4),
        lambda: ClipGradByQuantile(0.9, 4, global_threshold=True),
        lambda: torchclip.ClipGradByNormEMA(warmup_steps=3),
        lambda: ClipGradByUnitwiseNorm(0.05),
        lambda: torchclip.SkipStepOnSpike(torchclip.ClipGradByNormEMA(warmup_steps=2), window=4),
    ],
    ids=["zscore", "quantile", "quantile-global", "norm-ema", "unitwise", "skip-on-spike"],
)
def test_cuda_steps_never_wait_for_the_device(make_clip):
    """No host read of a norm during a step: every call, the first one included, under sync debug mode."""
    _, model = model_pair()
    model.cuda()
    clip = make_clip()
    runs = list(gradient_run(model, 10))
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for grads in runs:
            for p, g in zip(model.parameters(), grads):
                p.grad.copy_(g, non_blocking=True) if p.grad is not None else setattr(
                    p, "grad", g.cuda(non_blocking=True)
                )
            clip(model.parameters())
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    _, reference = model_pair()
    cpu_clip = make_clip()
    for grads in runs:
        set_grads(reference, grads)
        cpu_clip(reference.parameters())
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-5, atol=1e-8)
