"""norm_in_backward=True (torchclip/backward_norm.py): a folded clip's norm measured while backward runs is
the post-backward norm, the same bits with exact norms, and the parameters after N steps are those of the
same optimizer without it; a gradient that changed after its measurement is measured again, never stale.
Oracle: the same model, data and optimizer with norm_in_backward=False (the folded clip, already tested
against clip-then-step in tests/test_optim_fused.py), and torchclip.get_total_norm of the gradients the step
saw."""

import contextlib
import copy

import pytest
import torch
from testing import cuda_only

import torchclip
from torchclip import ClipGradByGlobalNorm, backward_norm

OPTIMIZERS = {
    "AdamW": {"lr": 1e-2, "weight_decay": 0.1},
    "SGD": {"lr": 1e-2, "momentum": 0.9},
    "Adagrad": {"lr": 1e-2},
}


class Model(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.first = torch.nn.Linear(16, 32).to(dtype)
        self.second = torch.nn.Linear(32, 4).to(dtype)
        self.unused = torch.nn.Linear(3, 3).to(dtype)  # never gets a gradient
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator).to(dtype))

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def batches(count, seed=1, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=generator) * 4).to(dtype) for _ in range(count)]


def optimizer_for(model, name, clip_norm=0.5, **kwargs):
    optimizer_class = getattr(torchclip.optim, name)
    clip = ClipGradByGlobalNorm(clip_norm, **kwargs.pop("clip", {}))
    return optimizer_class(model.parameters(), fused=True, grad_clip=clip, **OPTIMIZERS[name], **kwargs)


def train(model, optimizer, steps=4, micro_batches=1, pause_early=False, seed=1, dtype=torch.float32):
    """Steps of micro_batches backward passes each; pause_early: no_sync() for all but the last."""
    norms = []
    data = batches(steps * micro_batches, seed, dtype)
    attachment = optimizer.grad_clip_attachment
    for step in range(steps):
        optimizer.zero_grad()
        for k in range(micro_batches):
            x = data[step * micro_batches + k]
            if pause_early and k < micro_batches - 1:
                with attachment.backward_norms.no_sync():
                    model(x).square().mean().backward()
            else:
                model(x).square().mean().backward()
        expected = exact_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step()
        norm = optimizer.grad_clip.last_global_norm.clone()
        norms.append((norm, expected.to(norm.dtype)))
    return norms


def exact_norm(grads):
    """The gradients' exact 2-norm in float64 (a narrower result is this rounded once)."""
    return torchclip.get_total_norm([g.double() for g in grads], exact=True)


def assert_same_parameters(a, b, exact):
    for p, q in zip(a.parameters(), b.parameters()):
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("exact", [False, True], ids=["float64", "exact"])
def test_the_norm_from_backward_is_the_post_backward_norm(name, exact):
    ours, theirs = Model(), Model()
    optimizer = optimizer_for(ours, name, norm_in_backward=True, clip={"exact": exact})
    if not torchclip.optim._steps_fused(optimizer):
        pytest.skip(f"torch's fused {name} does not read grad_scale here: the clip is not folded")
    reference = optimizer_for(theirs, name, clip={"exact": exact})
    measured = train(ours, optimizer)
    after = train(theirs, reference)
    for (norm, expected), (their_norm, _) in zip(measured, after):
        if exact:
            assert torch.equal(norm, their_norm)
            assert torch.equal(norm, expected)
        else:
            torch.testing.assert_close(norm, their_norm, rtol=1e-6, atol=0)
    backward_norms = optimizer.grad_clip_attachment.backward_norms
    assert (backward_norms.taken_in_backward, backward_norms.taken_after_backward) == (4, 0)  # 2 layers x 2
    assert_same_parameters(ours, theirs, exact)


@pytest.mark.parametrize("pause_early", [False, True], ids=["every_micro_batch", "no_sync"])
def test_gradient_accumulation_counts_the_last_micro_batch(pause_early):
    ours, theirs = Model(), Model()
    optimizer = optimizer_for(ours, "AdamW", norm_in_backward=True, clip={"exact": True})
    reference = optimizer_for(theirs, "AdamW", clip={"exact": True})
    measured = train(ours, optimizer, micro_batches=3, pause_early=pause_early)
    train(theirs, reference, micro_batches=3)
    for norm, expected in measured:
        assert torch.equal(norm, expected)
    assert optimizer.grad_clip_attachment.backward_norms.taken_after_backward == 0
    assert_same_parameters(ours, theirs, exact=True)


@pytest.mark.parametrize("batch_bytes", [1, 600, 1 << 30], ids=["each", "several", "one"])
def test_batched_measurements_as_cuda_takes_them(monkeypatch, batch_bytes):
    """CUDA gradients are measured in batches (CUDA_BATCH_BYTES), the rest at the end of backward: that path
    on CPU gradients, with gradient accumulation, and a backward that raised before its end."""
    monkeypatch.setattr(backward_norm, "_measured_in_batches", lambda grad: True)
    monkeypatch.setattr(backward_norm, "CUDA_BATCH_BYTES", batch_bytes)
    ours, theirs = Model(), Model()
    optimizer = optimizer_for(ours, "AdamW", norm_in_backward=True)
    reference = optimizer_for(theirs, "AdamW")
    measured, after = train(ours, optimizer, micro_batches=3), train(theirs, reference, micro_batches=3)
    for (norm, _), (their_norm, _) in zip(measured, after):
        torch.testing.assert_close(norm, their_norm, rtol=1e-6, atol=0)
    backward_norms = optimizer.grad_clip_attachment.backward_norms
    assert (backward_norms.taken_in_backward, backward_norms.taken_after_backward) == (4, 0)
    assert_same_parameters(ours, theirs, exact=False)

    # A backward that raises after two gradients are final leaves them pending, its end never comes
    x = batches(1, seed=5)[0]
    failing = ours.first.weight.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("planted")))
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="planted"):
        ours(x).square().mean().backward()
    failing.remove()
    for model, opt in ((ours, optimizer), (theirs, reference)):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    torch.testing.assert_close(optimizer.grad_clip.last_global_norm, reference.grad_clip.last_global_norm)
    assert backward_norms.taken_after_backward == 0
    assert_same_parameters(ours, theirs, exact=False)


def test_a_hook_called_outside_backward_measures_at_once(monkeypatch):
    """The batched path queues its end-of-backward callback from the hook; called outside backward (no
    graph task to queue on), the hook measures the gradient at once instead."""
    monkeypatch.setattr(backward_norm, "_measured_in_batches", lambda grad: True)
    model = Model()
    optimizer = optimizer_for(model, "AdamW", norm_in_backward=True)
    backward_norms = optimizer.grad_clip_attachment.backward_norms
    weight = model.first.weight
    weight.grad = torch.randn_like(weight)
    backward_norms._on_final_grad(weight)
    assert not backward_norms._pending
    record = backward_norms._measured[id(weight)]
    torch.testing.assert_close(record.value, weight.grad.double().norm(), rtol=1e-6, atol=0)  # float32 blocks: 1e-6


CHANGES = {
    "in_place": lambda p: p.grad.mul_(3.0),
    "new_tensor": lambda p: setattr(p, "grad", p.grad * 3.0),
    "to_none": lambda p: setattr(p, "grad", None),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_gradient_changed_after_backward_is_measured_again(change):
    model = Model()
    optimizer = optimizer_for(model, "AdamW", norm_in_backward=True, clip={"exact": True})
    model(batches(1)[0]).square().mean().backward()
    CHANGES[change](model.first.weight)
    expected = exact_norm([p.grad for p in model.parameters() if p.grad is not None]).float()
    optimizer.step()
    assert torch.equal(optimizer.grad_clip.last_global_norm, expected)
    backward_norms = optimizer.grad_clip_attachment.backward_norms
    if change == "to_none":
        assert (backward_norms.taken_in_backward, backward_norms.taken_after_backward) == (3, 0)
    else:
        assert (backward_norms.taken_in_backward, backward_norms.taken_after_backward) == (3, 1)


def test_measurements_do_not_outlive_their_step():
    """A step uses up the measurements: a parameter with no new backward is measured at the next step."""
    model = Model()
    optimizer = optimizer_for(model, "SGD", norm_in_backward=True)
    model(batches(1)[0]).square().mean().backward()
    optimizer.step()
    optimizer.step()  # the same gradients, no backward between
    backward_norms = optimizer.grad_clip_attachment.backward_norms
    assert (backward_norms.taken_in_backward, backward_norms.taken_after_backward) == (0, 4)


def test_grad_scaler_norm_from_scaled_gradients():
    ours, theirs = Model(), Model()
    optimizer = optimizer_for(ours, "AdamW", norm_in_backward=True, clip={"exact": True})
    reference = optimizer_for(theirs, "AdamW", clip={"exact": True})
    for model, opt in ((ours, optimizer), (theirs, reference)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for x in batches(3):
            opt.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
    assert torch.equal(optimizer.grad_clip.last_global_norm, reference.grad_clip.last_global_norm)
    assert optimizer.grad_clip_attachment.backward_norms.taken_after_backward == 0
    assert_same_parameters(ours, theirs, exact=True)


def test_unscale_before_step_is_seen():
    """scaler.unscale_ changes every gradient in place after backward: all are measured again."""
    model = Model()
    optimizer = optimizer_for(model, "AdamW", norm_in_backward=True, clip={"exact": True})
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(batches(1)[0]).square().mean()).backward()
    scaler.unscale_(optimizer)
    expected = exact_norm([p.grad for p in model.parameters() if p.grad is not None]).float()
    scaler.step(optimizer)
    assert torch.equal(optimizer.grad_clip.last_global_norm, expected)
    assert optimizer.grad_clip_attachment.backward_norms.taken_after_backward == 4


def test_not_folded_clips_as_without(monkeypatch):
    """need_clip=False on one parameter: the clip runs in place (no fold) and the measurements are unused."""
    ours, theirs = Model(), Model()
    for model in (ours, theirs):
        torchclip.set_need_clip(model.second.bias, False)
    optimizer = optimizer_for(ours, "AdamW", norm_in_backward=True)
    reference = optimizer_for(theirs, "AdamW")
    assert optimizer.grad_clip_attachment.plan_for(optimizer).folded is None
    train(ours, optimizer)
    train(theirs, reference)
    assert_same_parameters(ours, theirs, exact=True)


def test_bfloat16_and_inference_of_the_dtype():
    model = Model(torch.bfloat16)
    optimizer = optimizer_for(model, "AdamW", norm_in_backward=True)
    (norm, expected), *_ = train(model, optimizer, steps=1, dtype=torch.bfloat16)
    assert norm.dtype == torch.float32  # at least float32, as the folded walk gives it
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)  # float64 accumulation, not exact


def test_remove_and_copies():
    model = Model()
    optimizer = optimizer_for(model, "AdamW", norm_in_backward=True)
    copied = copy.deepcopy(optimizer)
    assert copied.grad_clip_attachment.backward_norms is not None
    assert copied.grad_clip_attachment.backward_norms is not optimizer.grad_clip_attachment.backward_norms
    copied_params = [p for group in copied.param_groups for p in group["params"]]
    torch.stack([p.sum() for p in copied_params[:4]]).sum().backward()
    # The copy's hooks measured its parameters' gradients; the original's measured nothing.
    assert set(copied.grad_clip_attachment.backward_norms._measured) == {id(p) for p in copied_params[:4]}
    assert not optimizer.grad_clip_attachment.backward_norms._measured
    optimizer.grad_clip_attachment.remove()
    assert optimizer.grad_clip_attachment.backward_norms is None
    model(batches(1)[0]).sum().backward()  # no hook left to fire
    optimizer.step()


def test_bad_argument_names_it():
    with pytest.raises(TypeError, match="norm_in_backward must be True or False, got 'yes'"):
        optimizer_for(Model(), "AdamW", norm_in_backward="yes")


@cuda_only
@pytest.mark.parametrize("batch_bytes", [1, backward_norm.CUDA_BATCH_BYTES], ids=["each", "one-batch"])
def test_cuda_norm_from_backward(monkeypatch, batch_bytes):
    """On CUDA the hooks measure on the device in batches, behind backward's kernels; exact measurements wait
    for the step. The gradients are freed by zero_grad(set_to_none=True) each step."""
    monkeypatch.setattr(backward_norm, "CUDA_BATCH_BYTES", batch_bytes)
    side = torch.cuda.Stream()
    for exact, backward_stream in ((False, None), (True, None), (False, side)):
        ours, theirs = Model().cuda(), Model().cuda()
        optimizer = optimizer_for(ours, "AdamW", norm_in_backward=True, clip={"exact": exact})
        reference = optimizer_for(theirs, "AdamW", clip={"exact": exact})
        for model, opt in ((ours, optimizer), (theirs, reference)):
            for x in batches(3):
                opt.zero_grad(set_to_none=True)
                # A forward on a stream of its own: its stream writes the gradients and runs their hooks, and
                # the measurements run there, the last batch after autograd has synced the caller's stream
                # with it (at the end of backward), so the step must wait for them itself.
                if backward_stream is not None:
                    backward_stream.wait_stream(torch.cuda.current_stream())
                with contextlib.nullcontext() if backward_stream is None else torch.cuda.stream(backward_stream):
                    loss = model(x.cuda()).square().mean()
                loss.backward()
                opt.step()
        torch.testing.assert_close(optimizer.grad_clip.last_global_norm, reference.grad_clip.last_global_norm)
        assert optimizer.grad_clip_attachment.backward_norms.taken_after_backward == (4 if exact else 0)
        assert_same_parameters(ours, theirs, exact=False)


def test_under_torch_distributed_every_gradient_is_measured_at_the_step(tmp_path):
    """DDP may rewrite a gradient after its hook without a version bump: in a process group the hooks stand
    aside and the step reads every gradient, as without norm_in_backward."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = Model()
        optimizer = optimizer_for(model, "AdamW", norm_in_backward=True, clip={"exact": True})
        (norm, expected), *_ = train(model, optimizer, steps=1)
        assert torch.equal(norm, expected)
        backward_norms = optimizer.grad_clip_attachment.backward_norms
        assert (backward_norms.taken_in_backward, backward_norms.taken_after_backward) == (0, 4)
    finally:
        torch.distributed.destroy_process_group()


def test_reduced_by_refuses_what_is_not_ddp():
    optimizer = optimizer_for(Model(), "AdamW", norm_in_backward=True)
    with pytest.raises(TypeError, match="ddp_model must be a DistributedDataParallel, got Model"):
        optimizer.grad_clip_attachment.backward_norms.reduced_by(Model())
