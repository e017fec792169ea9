"""Paddle's set_gradient_clip examples (static-graph programs) as eager torch training loops.

Paddle builds a Program and calls fluid.clip.set_gradient_clip(clip, param_list, program); here the
program is the nn.Module that owns the parameters, and names are its parameter names.
"""

import warnings

import torch

import torchclip
from torchclip import ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue, set_gradient_clip


def network():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def train(model, optimizer, steps=10):
    for _ in range(steps):
        x, y = torch.randn(32, 13), torch.randn(32, 1)
        optimizer.zero_grad()
        (torch.nn.functional.mse_loss(model(x), y) * 1000).backward()
        optimizer.step()


def clear(model):
    set_gradient_clip(None)
    set_gradient_clip(None, program=model)


# Example 1: clip every parameter of the program by the global norm.
model = network()
set_gradient_clip(ClipGradByGlobalNorm(clip_norm=2.0), program=model)
train(model, torchclip.optim.SGD(model.parameters(), lr=0.01))
clear(model)

# Example 2: clip only some parameters, named.
model = network()
set_gradient_clip(ClipGradByValue(max=0.1), param_list=["0.weight", "2.weight"], program=model)
train(model, torchclip.optim.SGD(model.parameters(), lr=0.01))
clear(model)

# Example 3: different clips for different parameters, given as parameters.
model = network()
set_gradient_clip(ClipGradByNorm(clip_norm=1.0), param_list=[model[0].weight, model[0].bias])
set_gradient_clip(ClipGradByValue(max=0.5), param_list=[model[2].weight, model[2].bias])
train(model, torchclip.optim.SGD(model.parameters(), lr=0.01))
clear(model)

# Example 4: set_gradient_clip and the optimizer's grad_clip both set: the optimizer's wins, with a warning.
model = network()
set_gradient_clip(ClipGradByNorm(clip_norm=2.0), program=model)
optimizer = torchclip.optim.SGD(model.parameters(), lr=0.01, grad_clip=ClipGradByGlobalNorm(clip_norm=1.0))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    train(model, optimizer, steps=1)
assert any("takes precedence" in str(w.message) for w in caught)
total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
assert abs(total.item() - 1.0) < 1e-4, total  # the optimizer's global norm clip was applied
clear(model)
print("set_gradient_clip examples ran")
