"""Paddle's ClipGradByValue / ClipGradByNorm / ClipGradByGlobalNorm examples, rewritten for torch.

Paddle:
    linear = paddle.nn.Linear(10, 10, weight_attr=paddle.ParamAttr(need_clip=True),
                              bias_attr=paddle.ParamAttr(need_clip=False))
    clip = paddle.nn.ClipGradByGlobalNorm(clip_norm=1.0)
    sdg = paddle.optimizer.SGD(learning_rate=0.1, parameters=linear.parameters(), grad_clip=clip)
    sdg.step()

torchclip: the same, with set_need_clip standing in for ParamAttr(need_clip=...).
"""

import torch

import torchclip


def run(clip, steps=20):
    torch.manual_seed(0)
    linear = torch.nn.Linear(10, 10)
    torchclip.set_need_clip(linear.bias, False)  # bias_attr=paddle.ParamAttr(need_clip=False)
    sgd = torchclip.optim.SGD(linear.parameters(), lr=0.1, grad_clip=clip)
    for _ in range(steps):
        x = torch.rand(10, 10) * 2 - 1  # paddle.uniform([10, 10], min=-1.0, max=1.0)
        loss = linear(x).mean() * 100  # large gradients, so every clip has work to do
        sgd.zero_grad()
        loss.backward()
        bias_grad = linear.bias.grad.clone()
        sgd.step()
        assert torch.equal(linear.bias.grad, bias_grad), "need_clip=False: the bias is never clipped"
    return linear


if __name__ == "__main__":
    run(torchclip.ClipGradByValue(min=-1.0, max=1.0))
    run(torchclip.ClipGradByNorm(clip_norm=1.0))
    clip = torchclip.ClipGradByGlobalNorm(clip_norm=1.0)
    run(clip)
    print(f"last global norm before clipping: {clip.last_global_norm.item():.4f}")
