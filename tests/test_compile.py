"""torchclip under torch.compile: the ops trace (fake implementations) and give eager's results."""

import copy

import pytest
import torch

import torchclip


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def make_batches(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator)) for _ in range(steps)]


def train(model, step_fn, batches):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        norms.append(step_fn(model, optimizer, x, y))
    return norms


def training_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    norm = torchclip.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()
    return norm.detach()


def test_compiled_training_step_matches_eager():
    torch._dynamo.reset()
    batches = make_batches(8)
    eager_model = small_model()
    compiled_model = copy.deepcopy(eager_model)
    eager_norms = train(eager_model, training_step, batches)
    compiled_norms = train(compiled_model, torch.compile(training_step), batches)
    for a, b in zip(eager_norms, compiled_norms):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fn", ["clip_grad_norm_", "clip_grad_value_", "get_total_norm"])
def test_clipping_compiles_without_graph_breaks(fn):
    torch._dynamo.reset()
    model = small_model()
    torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 1)).backward()
    params = list(model.parameters())
    expected_params = copy.deepcopy(params)
    for p, q in zip(params, expected_params):
        q.grad = p.grad.clone()

    calls = {
        "clip_grad_norm_": lambda ps: torchclip.clip_grad_norm_(ps, 0.01),
        "clip_grad_value_": lambda ps: torchclip.clip_grad_value_(ps, 0.001),
        "get_total_norm": lambda ps: torchclip.get_total_norm([p.grad for p in ps], 1.0),
    }
    result = torch.compile(calls[fn], fullgraph=True)(params)  # fullgraph: a graph break would raise
    expected = calls[fn](expected_params)
    if expected is not None:
        torch.testing.assert_close(result, expected)
    for p, q in zip(params, expected_params):
        torch.testing.assert_close(p.grad, q.grad)
