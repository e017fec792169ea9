"""Benchmark workloads: parameter shapes of real models (shipped as JSON) and synthetic lists, and the gradients of
one backward of the --training models (BACKWARD)."""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
from importlib import resources

# name -> shapes, for the synthetic workloads; real models come from the JSON files beside this one.
SYNTHETIC = {
    "2000x64x64": [[64, 64]] * 2000,
    "10000x100": [[100]] * 10000,
    "64M": [[64 * 1024 * 1024]],
    "24x1M": [[1024 * 1024]] * 24,
}


# name -> the --training model (training.MODELS) whose gradients, from one backward of its batch with fresh weights,
# are the workload's values. Every other workload's values are Gaussian; real gradients have heavier tails, which the
# exact norm's checked blocks feel (docs/exact-norms-record.md, "Real gradients rise more").
BACKWARD = {"resnet50-backward": "resnet50", "gpt2-small-backward": "gpt2-small"}


def model_names() -> list[str]:
    return sorted(
        p.name[: -len(".json")]
        for p in resources.files(__package__).joinpath("workloads").iterdir()
        if p.name.endswith(".json")
    )


def names() -> list[str]:
    return model_names() + list(SYNTHETIC) + list(BACKWARD)


@functools.cache
def backward_gradients(name: str) -> tuple:
    """The float32 gradients of BACKWARD[name]'s model after one backward of its batch: seeded, so every process (and
    every build compare_builds runs) gets the same values. Once a process."""
    import torch

    from torchclip.bench import training  # (here: training imports timing, which imports this module)

    with torch.random.fork_rng():  # (the caller's random state untouched)
        torch.manual_seed(0)
        try:
            model, batch = training.MODELS[BACKWARD[name]]()
        except ImportError as error:
            raise ValueError(
                f"--workload {name!r} needs transformers (its model): pip install -r requirements-integration.txt"
            ) from error
        model(**batch).loss.backward()
    return tuple(p.grad.detach() for p in model.parameters() if p.grad is not None)


def values(workload: str):
    """The values a workload's gradients start from: a BACKWARD workload's model's gradients, else None (Gaussian)."""
    return backward_gradients(workload) if workload in BACKWARD else None


def shapes(name_or_path: str) -> list[list[int]]:
    """The parameter shapes of a workload: a name from names(), or a JSON file with a 'shapes' list."""
    if name_or_path in SYNTHETIC:
        return SYNTHETIC[name_or_path]
    if name_or_path in BACKWARD:
        return [list(g.shape) for g in backward_gradients(name_or_path)]
    if name_or_path in model_names():
        text = resources.files(__package__).joinpath("workloads", f"{name_or_path}.json").read_text()
    elif name_or_path.endswith(".json"):
        try:
            with open(name_or_path) as f:
                text = f.read()
        except OSError as error:
            raise ValueError(f"--workload {name_or_path!r}: cannot read the file ({error})") from error
    else:
        raise ValueError(f"--workload {name_or_path!r}: unknown; choose from {names()} or give a .json file of shapes")
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("shapes"), list):
        raise ValueError(f"--workload {name_or_path!r}: expected a JSON object with a 'shapes' list")
    return data["shapes"]


def model_shapes(spec: str) -> tuple[str, list[list[int]]]:
    """The parameter shapes of `module:callable`, a function or class building an nn.Module, built on
    the meta device (no memory, no initialisation cost)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model {spec!r}: expected module:callable, e.g. torchvision.models:resnet50")
    try:
        target = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--model {spec!r}: cannot import it ({error})") from error
    import torch

    with torch.device("meta"):
        model = target()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec!r}: calling it gave {type(model).__name__}, not an nn.Module")
    shape_list = [list(p.shape) for p in model.parameters()]
    if not shape_list:
        raise ValueError(f"--model {spec!r}: the module has no parameters")
    return attribute.split(".")[-1], shape_list


def resolve(workload: str) -> tuple[str, list[list[int]]]:
    """(label, shapes) of a workload name, a JSON file of shapes, or "model:module:callable"."""
    if workload.startswith("model:"):
        return model_shapes(workload[len("model:") :])
    label = os.path.basename(workload)[: -len(".json")] if workload.endswith(".json") else workload
    return label, shapes(workload)


def numel(shape_list: list[list[int]]) -> int:
    return sum(math.prod(s) for s in shape_list)
