"""Opacus's own optimizers with and without `torchclip.per_sample.patch_opacus()` (opacus 1.6.0, pinned in
requirements-integration.txt): a small model with a convolution, an embedding, layer norm and linear layers
trained by PrivacyEngine.make_private for several steps, flat and per layer.

Noise off, the patched run ends where Opacus's does, within float32 rounding (Opacus computes the norms and
clip factors in float32 and sums with einsum; torchclip takes the norms in float64 and sums in sample order).
Noise on, the patched run repeats bit for bit from one generator seed, its noise has the standard deviation
noise_multiplier * max_grad_norm / expected_batch_size, and the privacy accounting (the accountant's history) is
the same as Opacus's. Gradient accumulation over virtual batches (BatchMemoryManager's signal_skip_step) sums
into summed_grad as Opacus does."""

import pytest
import torch
from torch import nn

opacus = pytest.importorskip("opacus")

from opacus import GradSampleModule, PrivacyEngine
from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer

from torchclip import per_sample

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),  # (Opacus's reminder, on every make_private)
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),  # (integer token inputs)
]

BATCH, STEPS = 8, 4


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 6)
        self.conv = nn.Conv1d(6, 5, 3)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5 * 8, 3)

    def forward(self, tokens):
        x = self.conv(self.embedding(tokens).transpose(1, 2)).transpose(1, 2)
        return self.head(self.norm(x).flatten(1))


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 50, (BATCH, 10), generator=g), torch.randint(0, 3, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def train(patched, clipping="flat", noise_multiplier=0.0, seed=0, accumulate=False):
    """Parameters after STEPS steps, the gradients each step saw, and the accountant's history."""
    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="rdp")
    max_grad_norm = 0.3 if clipping == "flat" else [0.1 + 0.05 * i for i in range(len(list(model.parameters())))]
    model, optimizer, _ = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.zeros(BATCH * STEPS, 1)), batch_size=BATCH
        ),
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        clipping=clipping,
        poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(seed),
    )
    grads = []
    patch = per_sample.patch_opacus() if patched else None
    try:
        for step, (tokens, labels) in enumerate(data()):
            if accumulate and step % 2 == 0:
                optimizer.signal_skip_step(do_skip=True)
            loss = nn.functional.cross_entropy(model(tokens), labels)
            loss.backward()
            optimizer.step()
            if not (accumulate and step % 2 == 0):
                grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.zero_grad()
    finally:
        if patch is not None:
            patch.undo()
    return [p.detach().clone() for p in model.parameters()], grads, list(engine.accountant.history)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_noise_off_ends_where_opacus_does(clipping, accumulate, kernel_spy_per_sample):
    theirs, their_grads, _ = train(False, clipping, accumulate=accumulate)
    assert kernel_spy_per_sample.calls == 0
    ours, our_grads, _ = train(True, clipping, accumulate=accumulate)
    assert kernel_spy_per_sample.calls > 0
    for step, (a, b) in enumerate(zip(their_grads, our_grads)):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-7, msg=f"step {step}")
    for x, y in zip(theirs, ours):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(x, p) for x, p in zip(theirs, Small().parameters()))  # it trained


def test_noise_on_repeats_from_a_seed_and_accounts_as_opacus():
    sigma = 1.3
    _, grads_a, history_a = train(True, noise_multiplier=sigma, seed=4)
    _, grads_b, history_b = train(True, noise_multiplier=sigma, seed=4)
    _, grads_c, _ = train(True, noise_multiplier=sigma, seed=5)
    assert all(torch.equal(x, y) for a, b in zip(grads_a, grads_b) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for a, c in zip(grads_a, grads_c) for x, y in zip(a, c))
    _, _, their_history = train(False, noise_multiplier=sigma, seed=4)
    assert history_a == history_b == their_history
    # The noise itself: the difference from the noise-free step-1 gradient is N(0, (sigma C / B)^2).
    _, clean, _ = train(True)
    noise = torch.cat([(x - y).ravel() for x, y in zip(grads_a[0], clean[0])])
    expected = sigma * 0.3 / BATCH
    assert abs(noise.mean().item()) < 5 * expected / noise.numel() ** 0.5
    assert abs(noise.std().item() / expected - 1) < 5 / (2 * noise.numel()) ** 0.5


def test_patch_reaches_each_optimizer_and_undoes():
    originals = (DPOptimizer.clip_and_accumulate, DPOptimizer.add_noise, DPPerLayerOptimizer.clip_and_accumulate)
    with per_sample.patch_opacus():
        assert DPOptimizer.clip_and_accumulate is not originals[0]
        assert DPPerLayerOptimizer.clip_and_accumulate is not originals[2]
    assert (
        DPOptimizer.clip_and_accumulate,
        DPOptimizer.add_noise,
        DPPerLayerOptimizer.clip_and_accumulate,
    ) == originals


def test_opacus_processed_gradient_check_survives_the_patch():
    model = GradSampleModule(nn.Linear(4, 2))
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=3
    )
    with per_sample.patch_opacus():
        model(torch.randn(3, 4)).sum().backward()
        optimizer.pre_step()
        # Opacus's privacy check: a gradient used in a step must be cleared before the next
        with pytest.raises(ValueError, match="Gradients haven't been cleared"):
            optimizer.pre_step()


@pytest.fixture
def kernel_spy_per_sample(monkeypatch):
    """Counts calls into torchclip's per-sample op: proof the patched run used it and Opacus's did not."""
    from torchclip import _ops

    class Spy:
        calls = 0

    spy = Spy()
    original = _ops.per_sample_accumulate_

    def counted(*args, **kwargs):
        spy.calls += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(_ops, "per_sample_accumulate_", counted)
    return spy
