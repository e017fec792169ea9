"""Clipping as an optimizer hook: grad_clip=, param groups, set_gradient_clip, AMP, checkpoints."""

import copy
import io
import warnings

import pytest
import torch

import torchclip
import torchclip.clip as clip_module
from torchclip import ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue, set_gradient_clip


def f32(value):
    """value rounded to float32, as a clamp bound is before it is applied."""
    return torch.tensor(value, dtype=torch.float32).item()


@pytest.fixture(autouse=True)
def _no_global_default_clip():
    yield
    clip_module._default_clip = None


def tiny_transformer(seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 32), torch.nn.TransformerEncoder(layer, num_layers=2), torch.nn.Linear(32, 50)
    )


def synthetic_batches(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 50, (8, 16), generator=generator)
        yield tokens, (tokens * 7 + 3) % 50  # a fixed token-to-token map: learnable


def loss_of(model, tokens, targets):
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def train(model, optimizer, steps, clip_by_hand=None, scaler=None, scheduler=None):
    for tokens, targets in synthetic_batches(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens, targets)
        if scaler is None:
            loss.backward()
            if clip_by_hand is not None:
                clip_by_hand(list(model.parameters()))
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if clip_by_hand is not None:
                scaler.unscale_(optimizer)
                clip_by_hand(list(model.parameters()))
            scaler.step(optimizer)
            scaler.update()
        if scheduler is not None:
            scheduler.step()
    return loss.item()


@pytest.mark.parametrize("use_scaler", [False, True])
def test_grad_clip_on_the_optimizer_equals_clipping_by_hand(use_scaler):
    steps = 300
    by_hook = tiny_transformer()
    by_hand = copy.deepcopy(by_hook)
    hook_opt = torchclip.optim.AdamW(by_hook.parameters(), lr=3e-3, grad_clip=ClipGradByGlobalNorm(0.5))
    hand_opt = torch.optim.AdamW(by_hand.parameters(), lr=3e-3)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=100, gamma=0.5) for o in (hook_opt, hand_opt)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) if use_scaler else None for _ in range(2)]
    hook_loss = train(by_hook, hook_opt, steps, scaler=scalers[0], scheduler=schedulers[0])
    hand_loss = train(
        by_hand, hand_opt, steps, clip_by_hand=ClipGradByGlobalNorm(0.5), scaler=scalers[1], scheduler=schedulers[1]
    )
    assert hook_loss == hand_loss and hook_loss < 3.0  # it learned, identically
    for p, q in zip(by_hook.parameters(), by_hand.parameters()):
        assert torch.equal(p, q)


class CountingClip(ClipGradByValue):
    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0

    def __call__(self, params_grads):
        self.calls += 1
        return super().__call__(params_grads)


def test_a_step_gradscaler_skips_is_not_clipped():
    model = torch.nn.Linear(4, 1)
    clip = CountingClip(1e-3)
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=clip)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    weight = model.weight.detach().clone()
    scaler.step(optimizer)
    assert clip.calls == 0 and torch.equal(model.weight, weight)  # skipped: no clip, no update
    optimizer.zero_grad()
    scaler.update()
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(optimizer)
    assert clip.calls == 1
    assert model.weight.grad.abs().max().item() <= f32(1e-3)  # unscaled, then clipped


def test_attach_and_remove():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = torchclip.optim.attach(optimizer, ClipGradByValue(1e-4))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    assert model.weight.grad.abs().max().item() <= f32(1e-4)
    handle.remove()
    model.weight.grad.fill_(1.0)
    optimizer.step()
    assert model.weight.grad.max().item() == 1.0


def test_with_grad_clip_works_for_any_optimizer_class():
    class MyOptimizer(torch.optim.SGD):
        pass

    Clipped = torchclip.optim.with_grad_clip(MyOptimizer)
    assert issubclass(Clipped, MyOptimizer) and Clipped.__name__ == "MyOptimizer"
    model = torch.nn.Linear(3, 3)
    optimizer = Clipped(model.parameters(), lr=0.0, grad_clip=ClipGradByNorm(1e-3))
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    assert model.weight.grad.norm().item() == pytest.approx(1e-3, rel=1e-5)
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer subclass"):
        torchclip.optim.with_grad_clip(int)
    with pytest.raises(TypeError, match="grad_clip must be a torchclip clip"):
        torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=1.0)


def test_param_groups_carry_their_own_clip():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    first, second = ClipGradByValue(1e-4), ClipGradByNorm(1e-2)
    optimizer = torchclip.optim.SGD(
        [{"params": model[0].parameters(), "grad_clip": first}, {"params": model[1].parameters()}],
        lr=0.0,
        grad_clip=second,
    )
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert model[0].weight.grad.abs().max().item() <= f32(1e-4)
    assert model[1].weight.grad.norm().item() == pytest.approx(1e-2, rel=1e-5)
    with pytest.raises(TypeError, match=r"param_group\['grad_clip'\] must be a torchclip clip"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "grad_clip": "x"})


def test_one_clip_object_serves_all_its_groups_with_one_global_norm():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    clip = ClipGradByGlobalNorm(1e-2)
    optimizer = torchclip.optim.SGD(
        [{"params": model[0].parameters(), "weight_decay": 0.1}, {"params": model[1].parameters()}],
        lr=0.0,
        grad_clip=clip,
    )
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert total.item() == pytest.approx(1e-2, rel=1e-5)


def test_state_dict_round_trip_keeps_clips_and_loads_weights_only():
    model = torch.nn.Linear(4, 4)
    clip = ClipGradByGlobalNorm(1.0)
    optimizer = torchclip.optim.Adam(
        [{"params": [model.weight], "grad_clip": ClipGradByValue(0.5)}, {"params": [model.bias]}],
        lr=0.1,
        grad_clip=clip,
    )
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all("grad_clip" not in group for group in state["param_groups"])
    fresh = torchclip.optim.Adam(
        [{"params": [model.weight], "grad_clip": ClipGradByValue(0.25)}, {"params": [model.bias]}],
        lr=0.1,
        grad_clip=clip,
    )
    fresh.load_state_dict(state)
    assert isinstance(fresh.param_groups[0]["grad_clip"], ClipGradByValue)
    assert fresh.param_groups[0]["grad_clip"].max == 0.25 and fresh.grad_clip is clip
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


# ---- set_gradient_clip ---------------------------------------------------------------------------


def test_set_gradient_clip_by_parameters_and_by_names():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    set_gradient_clip(ClipGradByValue(1e-4), param_list=["0.weight", "0.bias"], program=model)
    set_gradient_clip(ClipGradByNorm(1e-2), param_list=[model[1].weight])
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.0)
    model(torch.randn(3, 4)).sum().backward()
    bias_before = model[1].bias.grad.clone()
    optimizer.step()
    assert model[0].weight.grad.abs().max().item() <= f32(1e-4) and model[0].bias.grad.abs().max().item() <= f32(1e-4)
    assert model[1].weight.grad.norm().item() == pytest.approx(1e-2, rel=1e-5)
    assert torch.equal(model[1].bias.grad, bias_before)  # no clip set for it


def test_set_gradient_clip_default_for_every_parameter():
    model = torch.nn.Linear(4, 4)
    set_gradient_clip(ClipGradByValue(1e-4))
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.0)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert model.weight.grad.abs().max().item() <= f32(1e-4)


def test_optimizer_grad_clip_wins_over_set_gradient_clip_with_a_warning():
    model = torch.nn.Linear(4, 4)
    set_gradient_clip(ClipGradByValue(1e-6), program=model)
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.0, grad_clip=ClipGradByNorm(1e-2))
    model(torch.randn(3, 4)).sum().backward()
    with pytest.warns(UserWarning, match="optimizer's grad_clip takes precedence"):
        optimizer.step()
    assert model.weight.grad.norm().item() == pytest.approx(1e-2, rel=1e-5)


def test_global_norm_groups_by_group_name_and_checks_clip_norm():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    set_gradient_clip(ClipGradByGlobalNorm(1e-2, group_name="a"), param_list=list(model[0].parameters()))
    set_gradient_clip(ClipGradByGlobalNorm(1e-2, group_name="a"), param_list=list(model[1].parameters()))
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.0)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert total.item() == pytest.approx(1e-2, rel=1e-5)  # one global norm over both
    set_gradient_clip(ClipGradByGlobalNorm(5.0, group_name="a"), param_list=list(model[1].parameters()))
    with pytest.raises(ValueError, match="All parameters' 'clip_norm' of a same group should be the same"):
        optimizer.step()


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: set_gradient_clip("clip"), TypeError, "clip must be a ClipGradBase instance"),
        (lambda m: set_gradient_clip(ClipGradByNorm(1.0), ["0.weight"]), ValueError, "parameter names need `program`"),
        (lambda m: set_gradient_clip(ClipGradByNorm(1.0), ["nope"], m), ValueError, r"no parameter named \['nope'\]"),
        (lambda m: set_gradient_clip(ClipGradByNorm(1.0), ["weight", 3], m), TypeError, "list of parameters or a list"),
        (
            lambda m: set_gradient_clip(ClipGradByNorm(1.0), None, "main"),
            TypeError,
            "program must be the torch.nn.Module",
        ),
    ],
)
def test_set_gradient_clip_errors(call, error, message):
    with pytest.raises(error, match=message):
        call(torch.nn.Linear(2, 2))


# ---- torch.compile ------------------------------------------------------------------------------


def test_compiled_training_step_with_grad_clip():
    torch._dynamo.reset()
    eager_model = tiny_transformer()
    compiled_model = copy.deepcopy(eager_model)
    optimizers = [
        torchclip.optim.SGD(m.parameters(), lr=0.05, grad_clip=ClipGradByGlobalNorm(0.5))
        for m in (eager_model, compiled_model)
    ]

    def step(model, optimizer, tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens, targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    compiled_step = torch.compile(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tokens, targets in synthetic_batches(5):
            a = step(eager_model, optimizers[0], tokens, targets)
            b = compiled_step(compiled_model, optimizers[1], tokens, targets)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("clip", [ClipGradByGlobalNorm(0.1, nonfinite="skip"), ClipGradByNorm(0.1, nonfinite="skip")])
def test_nonfinite_skip_leaves_gradients_and_skips_the_step(clip):
    model = torch.nn.Linear(4, 2)
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=clip)
    model(torch.randn(3, 4)).sum().backward()
    model.bias.grad[0] = float("nan")
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert optimizer.grad_clip_attachment.skipped_steps == 1
    assert bool(clip.found_nonfinite) and int(clip.nonfinite_steps) == 1
    for p, g, w in zip(model.parameters(), grads, weights):
        assert torch.equal(p.grad.nan_to_num(), g.nan_to_num()) and torch.equal(p.detach(), w)
    optimizer.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # finite again: clipped and taken
    assert optimizer.grad_clip_attachment.skipped_steps == 1 and not bool(clip.found_nonfinite)
    assert not torch.equal(model.weight.detach(), weights[0])


def test_nonfinite_raise_and_propagate():
    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    before = model.bias.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        ClipGradByGlobalNorm(0.1, nonfinite="raise")(model.parameters())
    assert torch.equal(model.bias.grad, before)
    ClipGradByGlobalNorm(0.1)(model.parameters())  # propagate: torch's and Paddle's behaviour
    assert (model.bias.grad == 0).all()  # scaled by 0.1 / inf
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        ClipGradByGlobalNorm(0.1, nonfinite="ignore")


# ---- step(closure): the closure makes the gradients, so the clip comes after it ----------------

CLOSURE_CLIPS = [
    lambda: ClipGradByValue(0.01),
    lambda: ClipGradByNorm(0.05),
    lambda: ClipGradByGlobalNorm(0.1),
    lambda: torchclip.GradientClipByGlobalNorm(0.1, need_clip=lambda p: p.dim() > 1),
]


def closure_for(model, optimizer, batches, clip_by_hand=None):
    """The closure a training loop (or Lightning) passes to step(): zero_grad, forward, backward; the
    reference run clips by hand at its end, which is where the hook must clip."""
    tokens, targets = batches

    def closure():
        optimizer.zero_grad()
        loss = loss_of(model, tokens, targets)
        loss.backward()
        if clip_by_hand is not None:
            clip_by_hand(list(model.parameters()))
        return loss

    return closure


@pytest.mark.parametrize("make_clip", CLOSURE_CLIPS, ids=["value", "norm", "global_norm", "legacy_need_clip"])
@pytest.mark.parametrize(
    "optimizer_class", [torch.optim.SGD, torch.optim.Adam, torch.optim.LBFGS], ids=lambda c: c.__name__
)
@pytest.mark.parametrize("closure_as_keyword", [False, True])
def test_step_with_a_closure_clips_what_the_closure_made(make_clip, optimizer_class, closure_as_keyword):
    by_hook, by_hand, unclipped = tiny_transformer(), tiny_transformer(), tiny_transformer()
    kwargs = {"lr": 0.5, "max_iter": 3} if optimizer_class is torch.optim.LBFGS else {"lr": 0.05}
    hook_opt = torchclip.optim.with_grad_clip(optimizer_class)(by_hook.parameters(), grad_clip=make_clip(), **kwargs)
    hand_opt = optimizer_class(by_hand.parameters(), **kwargs)
    plain_opt = optimizer_class(unclipped.parameters(), **kwargs)
    hand_clip = make_clip()
    for batch in synthetic_batches(3):
        hook_closure = closure_for(by_hook, hook_opt, batch)
        hook_loss = hook_opt.step(closure=hook_closure) if closure_as_keyword else hook_opt.step(hook_closure)
        hand_loss = hand_opt.step(closure_for(by_hand, hand_opt, batch, clip_by_hand=hand_clip))
        plain_opt.step(closure_for(unclipped, plain_opt, batch))
        assert torch.equal(hook_loss, hand_loss)  # the closure's loss comes back
    for p, q in zip(by_hook.parameters(), by_hand.parameters()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in zip(by_hook.parameters(), unclipped.parameters()))


def test_step_with_a_closure_reports_the_norm_it_clipped():
    model = torch.nn.Linear(4, 1)
    clip = ClipGradByGlobalNorm(0.5)
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=clip)
    inputs, targets = torch.randn(8, 4), torch.randn(8, 1) * 10

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return loss

    optimizer.step(closure)
    assert clip.last_global_norm is not None and float(clip.last_global_norm) > 0.5
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    torch.testing.assert_close(total, torch.tensor(0.5), rtol=1e-6, atol=0)  # what the update used


@pytest.mark.parametrize("clip", [ClipGradByGlobalNorm(0.1, nonfinite="skip"), ClipGradByNorm(0.1, nonfinite="skip")])
def test_step_with_a_nonfinite_closure_is_skipped_and_returns_its_loss(clip):
    model = torch.nn.Linear(4, 2)
    optimizer = torchclip.optim.Adam(model.parameters(), lr=0.1, grad_clip=clip)
    weights = [p.detach().clone() for p in model.parameters()]
    calls = []

    def closure():
        calls.append(1)
        optimizer.zero_grad()
        loss = model(torch.randn(3, 4)).sum()
        loss.backward()
        model.bias.grad[0] = float("nan")
        return loss

    loss = optimizer.step(closure)
    assert len(calls) == 1 and loss is not None and loss.requires_grad
    assert optimizer.grad_clip_attachment.skipped_steps == 1 and bool(clip.found_nonfinite)
    assert optimizer.state == {}  # Adam never ran
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p.detach(), w)


def test_removed_hook_passes_the_closure_through():
    model = torch.nn.Linear(4, 2)
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=ClipGradByValue(1e-6))
    optimizer.grad_clip_attachment.remove()
    calls = []

    def closure():
        calls.append(1)
        optimizer.zero_grad()
        loss = model(torch.ones(1, 4)).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    assert len(calls) == 1 and float(model.bias.grad.abs().max()) == 1.0  # ran once, not clipped
