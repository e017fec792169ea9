"""torchclip inside real training frameworks: Lightning, accelerate, transformers.

`pytest -m integration` selects these. The frameworks are pinned in requirements-integration.txt (which
requirements-dev.txt includes); where one is not installed (the CUDA venv) the module is skipped.

Each test trains a tiny model for a few steps with torchclip and again with torch's own clipping and
compares the parameters: bit for bit where the maths is the same (value clipping: one clamp either way),
and to a tight tolerance where torchclip computes differently on purpose (norms: torchclip accumulates
the norm and its clip coefficient in float64, torch in float32, so the coefficient may differ in its last
float32 bit; Paddle's ClipGradByGlobalNorm scales by c / max(norm, c), torch by c / (norm + 1e-6)). Each
also proves that torchclip ran, by counting the calls into its kernels (testing.KernelSpy, a spy on
torchclip._ops), that the torch run did not, and that clipping did something (the unclipped run ends
elsewhere).

Where each framework clips (the installed sources, the versions in requirements-integration.txt):
* Lightning: the precision plugin (pytorch_lightning/plugins/precision/precision.py, clip_grad_by_value /
  clip_grad_by_norm) calls torch.nn.utils.clip_grad_value_ / clip_grad_norm_ by attribute at call time,
  so patch() reaches it. It clips inside the closure it hands to optimizer.step(closure=...), after
  backward and before the update, which is also where torchclip.optim's grad_clip= hook clips.
  Not reached: FSDP1 (its precision plugin refuses "norm"; Fabric calls module.clip_grad_norm_ of the
  FullyShardedDataParallel), DeepSpeed (clips inside its engine).
* accelerate: Accelerator.clip_grad_norm_ -> _clip_grad_norm_dtensor_aware -> torch.nn.utils.clip_grad_norm_
  (or get_total_norm + clip_grads_with_norm_ for gradients on several meshes), clip_grad_value_ ->
  torch.nn.utils.clip_grad_value_: reached. Not reached: FSDP1 (model.clip_grad_norm_), DeepSpeed (the
  engine clips; accelerate only reads its norm), XLA + FSDP.
* transformers: Trainer._clip_grad_norm -> self.accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
  (and, for mixed-mesh DTensor gradients, torch.nn.utils.get_total_norm / clip_grads_with_norm_ imported
  at call time): reached through accelerate. Not reached: SageMaker MP fp16 (clip_master_grads), and
  whatever accelerate does not reach.
"""

import functools
import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")
accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import torchclip

STEPS = 4

# torch's own functions, as imported before any patch().
TORCH_CLIP_GRAD_NORM_ = torch.nn.utils.clip_grad_norm_
TORCH_CLIP_GRAD_VALUE_ = torch.nn.utils.clip_grad_value_

# Lightning's advice to use DataLoader workers, its note that the dataloader is small, etc.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:pytorch_lightning"),
    pytest.mark.filterwarnings("ignore::UserWarning:lightning_fabric"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings(r"ignore:.*isinstance\(treespec, LeafSpec\)"),
]


@pytest.fixture(autouse=True)
def _nothing_patched():
    """Every test starts and ends with torch's own functions in torch.nn.utils."""
    assert torch.nn.utils.clip_grad_norm_ is TORCH_CLIP_GRAD_NORM_
    yield
    assert torch.nn.utils.clip_grad_norm_ is TORCH_CLIP_GRAD_NORM_
    assert torch.nn.utils.clip_grad_value_ is TORCH_CLIP_GRAD_VALUE_


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps process-wide state (AcceleratorState, GradientState); transformers' Trainer and
    Accelerator(cpu=True) both create it: each test gets a fresh one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_params_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e), (a - e).abs().max()


def assert_params_close(actual, expected):
    """For norm clipping, whose coefficient torchclip computes from a float64 norm (torch: float32), or by
    Paddle's formula: the parameters may differ in their last bits after a few steps."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-8)


def assert_params_differ(actual, expected):
    assert any(not torch.allclose(a, e, rtol=1e-3, atol=1e-4) for a, e in zip(actual, expected)), (
        "clipping changed nothing: the test would pass without it"
    )


# ---- Lightning ------------------------------------------------------------------------------------


def regression_batches():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 8, 8, generator=generator)
    y = torch.randn(STEPS * 8, 4, generator=generator) * 10  # far from the initial outputs: large gradients
    return x, y


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


class Regression(pl.LightningModule):
    """A tiny MLP; `optimizer` builds its optimizer from its parameters (default: torch's SGD)."""

    def __init__(self, optimizer=None):
        super().__init__()
        self.net = small_net()
        self.make_optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.05))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def fit(module, tmp_path, **trainer_kwargs) -> list[torch.Tensor]:
    x, y = regression_batches()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == STEPS
    return params_of(module)


def torch_lightning_run(clip_val, algorithm, tmp_path, kernel_spy):
    """Lightning's own clipping (torch.nn.utils, unpatched); torchclip must not run."""
    kernel_spy.reset()
    params = fit(
        Regression(),
        tmp_path / f"torch-{clip_val}-{algorithm}",
        gradient_clip_val=clip_val,
        gradient_clip_algorithm=algorithm,
    )
    assert kernel_spy.clips == 0
    return params


@pytest.mark.integration
@pytest.mark.parametrize("algorithm, clip_val", [("norm", 0.5), ("value", 0.05)])
def test_lightning_gradient_clip_val_under_patch(algorithm, clip_val, kernel_spy, tmp_path):
    expected = torch_lightning_run(clip_val, algorithm, tmp_path, kernel_spy)
    unclipped = torch_lightning_run(None, None, tmp_path, kernel_spy)
    assert_params_differ(expected, unclipped)

    kernel_spy.reset()
    with torchclip.patch():
        # Lightning's precision plugin reads torch.nn.utils.clip_grad_{norm,value}_ when it clips.
        assert torch.nn.utils.clip_grad_norm_ is torchclip.clip_grad_norm_
        assert torch.nn.utils.clip_grad_value_ is torchclip.clip_grad_value_
        actual = fit(Regression(), tmp_path / "patched", gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
    assert kernel_spy.clips == STEPS, kernel_spy.calls  # one torchclip clip per step
    if algorithm == "value":
        assert_params_equal(actual, expected)  # the same clamp
    else:
        assert_params_close(actual, expected)  # coefficient from a float64 norm (torch: float32)


@pytest.mark.integration
@pytest.mark.parametrize(
    "algorithm, make_clip",
    [("value", lambda: torchclip.ClipGradByValue(0.05)), ("norm", lambda: torchclip.ClipGradByGlobalNorm(0.5))],
)
def test_lightning_optimizer_with_grad_clip(algorithm, make_clip, kernel_spy, tmp_path):
    """configure_optimizers returns torchclip.optim.SGD(grad_clip=...): Lightning steps it with a closure
    (automatic optimization), so the hook must clip after the closure's backward."""
    c = 0.05 if algorithm == "value" else 0.5
    expected = torch_lightning_run(c, algorithm, tmp_path, kernel_spy)
    unclipped = torch_lightning_run(None, None, tmp_path, kernel_spy)
    assert_params_differ(expected, unclipped)

    kernel_spy.reset()
    clip = make_clip()
    module = Regression(lambda params: torchclip.optim.SGD(params, lr=0.05, grad_clip=clip))
    actual = fit(module, tmp_path / "torchclip")
    assert kernel_spy.clips == STEPS, kernel_spy.calls
    if algorithm == "value":
        assert_params_equal(actual, expected)  # the same clamp, at the same point of the step
    else:
        assert clip.last_global_norm.item() > c  # it clipped on the last step
        # Paddle's c / max(norm, c) against torch's c / (norm + 1e-6): 1e-6 / norm relative per step.
        assert_params_close(actual, expected)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_lightning_16_mixed_fused_optimizer_with_grad_clip(name, tmp_path):
    """precision="16-mixed" with a fused optimizer: Lightning refuses gradient_clip_val (the fused kernel
    unscales inside the step, so nothing can clip between unscaling and the update), while torchclip's
    grad_clip= folds the clip into that kernel. Oracle: the same optimizer unfused, which Lightning
    unscales and clips with torch's clip_grad_norm_. (SGD is there because AdamW hardly sees a clip that
    scales every step alike: its update is invariant to the gradients' scale.)"""
    kwargs = {"lr": 0.05, "momentum": 0.9} if name == "SGD" else {"lr": 0.05}
    fused = functools.partial(getattr(torch.optim, name), fused=True, **kwargs)

    def fp16(**trainer_kwargs):
        # Trainer(precision="16-mixed") turns into bf16-mixed on a CPU; the plugin itself keeps float16
        # autocast and a torch.amp.GradScaler, as on a GPU (whose default first scale, 2**16, would
        # overflow every one of these few steps).
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        return {"plugins": [pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)], **trainer_kwargs}

    with pytest.raises(RuntimeError, match="fused"):
        fit(Regression(fused), tmp_path / "refused", **fp16(gradient_clip_val=0.5))
    expected = fit(
        Regression(functools.partial(getattr(torch.optim, name), foreach=True, **kwargs)),
        tmp_path / "torch",
        **fp16(gradient_clip_val=0.5, gradient_clip_algorithm="norm"),
    )
    unclipped = fit(Regression(fused), tmp_path / "unclipped", **fp16())
    assert_params_differ(expected, unclipped)

    clip = torchclip.ClipGradByGlobalNorm(0.5)
    module = Regression(lambda params: getattr(torchclip.optim, name)(params, fused=True, grad_clip=clip, **kwargs))
    actual = fit(module, tmp_path / "torchclip", **fp16())
    assert module.trainer.precision_plugin.scaler.get_scale() == 256.0  # no step overflowed; the clip saw scaled grads
    optimizer = module.optimizers().optimizer
    assert optimizer.grad_clip_attachment.plan_for(optimizer).folded is clip
    assert clip.last_global_norm.item() > 0.5  # the unscaled norm: it clipped on the last step
    # fused against foreach, and Paddle's 0.5 / max(norm, 0.5) against torch's 0.5 / (norm + 1e-6)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


class ClipHookRegression(Regression):
    """Clips in configure_gradient_clipping with a torchclip class, ignoring Lightning's arguments."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip([p for group in optimizer.param_groups for p in group["params"]])


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_configure_gradient_clipping(algorithm, kernel_spy, tmp_path):
    c = 0.5 if algorithm == "norm" else 0.05
    expected = torch_lightning_run(c, algorithm, tmp_path, kernel_spy)
    unclipped = torch_lightning_run(None, None, tmp_path, kernel_spy)
    assert_params_differ(expected, unclipped)

    kernel_spy.reset()
    clip = torchclip.ClipGradByGlobalNorm(c) if algorithm == "norm" else torchclip.ClipGradByValue(c)
    actual = fit(ClipHookRegression(clip), tmp_path / "torchclip")
    assert kernel_spy.clips == STEPS, kernel_spy.calls
    if algorithm == "value":
        assert_params_equal(actual, expected)
    else:
        assert clip.last_global_norm.item() > c
        assert_params_close(actual, expected)  # Paddle's formula (no 1e-6)


# ---- accelerate -----------------------------------------------------------------------------------


def accelerate_run(algorithm, clip_val):
    """A plain training loop on Accelerator(cpu=True); returns the parameters and what clip_grad_norm_
    returned at each step."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = regression_batches()
    norms = []
    for xb, yb in zip(x.split(8), y.split(8)):
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(xb), yb))
        if algorithm == "norm":
            norms.append(accelerator.clip_grad_norm_(model.parameters(), clip_val).detach().clone())
        elif algorithm == "value":
            accelerator.clip_grad_value_(model.parameters(), clip_val)
        optimizer.step()
    return params_of(model), norms


@pytest.mark.integration
@pytest.mark.parametrize("algorithm, clip_val", [("norm", 0.5), ("value", 0.05)])
def test_accelerate_clip_under_patch(algorithm, clip_val, kernel_spy):
    expected, expected_norms = accelerate_run(algorithm, clip_val)
    assert kernel_spy.clips == 0
    unclipped, _ = accelerate_run(None, None)
    assert_params_differ(expected, unclipped)

    kernel_spy.reset()
    with torchclip.patch():
        actual, norms = accelerate_run(algorithm, clip_val)
    assert kernel_spy.clips == STEPS, kernel_spy.calls
    if algorithm == "value":
        assert_params_equal(actual, expected)
    else:
        assert_params_close(actual, expected)
        # The returned norms: torchclip's float64 sum rounded to float32 against torch's float32 sum.
        torch.testing.assert_close(torch.stack(norms), torch.stack(expected_norms), rtol=1e-6, atol=0)
        assert all(n.item() > clip_val for n in norms)


# ---- transformers ---------------------------------------------------------------------------------


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, vocab_size, n=16, length=12):
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, vocab_size, (n, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@functools.cache
def tiny_gpt2_state():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    return config, {k: v.clone() for k, v in GPT2LMHeadModel(config).state_dict().items()}


def transformers_run(max_grad_norm, output_dir):
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    config, state = tiny_gpt2_state()
    model = GPT2LMHeadModel(config)
    model.load_state_dict(state)
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        max_grad_norm=max_grad_norm,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(config.vocab_size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.state.global_step == STEPS
    return params_of(model)


@pytest.mark.integration
def test_transformers_trainer_max_grad_norm_under_patch(kernel_spy, tmp_path):
    max_grad_norm = 0.05
    expected = transformers_run(max_grad_norm, tmp_path / "torch")
    assert kernel_spy.clips == 0
    unclipped = transformers_run(0.0, tmp_path / "unclipped")
    assert_params_differ(expected, unclipped)

    kernel_spy.reset()
    with torchclip.patch():
        actual = transformers_run(max_grad_norm, tmp_path / "patched")
    # Trainer._clip_grad_norm -> Accelerator.clip_grad_norm_ -> torch.nn.utils.clip_grad_norm_, once a step.
    assert kernel_spy.clips == STEPS, kernel_spy.calls
    assert_params_close(actual, expected)
