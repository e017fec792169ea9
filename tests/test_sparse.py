"""Sparse COO gradients (nn.Embedding(sparse=True)): norms of coalesced values, in-place clipping."""

import copy
import math

import pytest
import torch

import torchclip


def sparse_grad(values, indices, size):
    return torch.sparse_coo_tensor(torch.tensor(indices), torch.tensor(values), size, check_invariants=True)


def embedding_models(seed=0):
    torch.manual_seed(seed)
    sparse = torch.nn.Sequential(torch.nn.Embedding(100, 16, sparse=True), torch.nn.Linear(16, 4))
    dense = copy.deepcopy(sparse)
    dense[0].sparse = False
    return sparse, dense


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 0.0, 3.0, -math.inf, -1.0])
def test_norm_of_an_uncoalesced_gradient_counts_duplicates_once(norm_type):
    # index 1 appears twice: its value is 3 + 4 = 7, not two entries 3 and 4
    g = sparse_grad([[3.0, 0.0], [4.0, 0.0], [1.0, 2.0]], [[1, 1, 3]], (5, 2))
    dense = g.to_dense()
    total = torchclip.get_total_norm([g, torch.ones(3)], norm_type)
    expected = torch.nn.utils.get_total_norm([dense, torch.ones(3)], norm_type)
    torch.testing.assert_close(total, expected)


@pytest.mark.parametrize("clip", ["norm", "value", "global", "per_tensor", "by_value"])
def test_sparse_embedding_training_matches_a_dense_reference(clip):
    sparse_model, dense_model = embedding_models()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (sparse_model, dense_model)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(30):
        tokens = torch.randint(0, 100, (8, 5), generator=generator)  # repeats: uncoalesced gradients
        target = torch.randn(8, 5, 4, generator=generator)
        for model, optimizer in zip((sparse_model, dense_model), optimizers):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(tokens), target * 10).backward()
            params = list(model.parameters())
            if clip == "norm":
                torchclip.clip_grad_norm_(params, 0.5)
            elif clip == "value":
                torchclip.clip_grad_value_(params, 0.01)
            elif clip == "global":
                torchclip.ClipGradByGlobalNorm(0.5)(params)
            elif clip == "per_tensor":
                torchclip.ClipGradByNorm(0.2)(params)
            else:
                torchclip.ClipGradByValue(0.01)(params)
            optimizer.step()
    assert sparse_model[0].weight.grad.is_sparse
    for p, q in zip(sparse_model.parameters(), dense_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _torch_clips_sparse_gradients() -> bool:
    """torch.nn.utils.clip_grad_norm_ raises NotImplementedError on sparse gradients up to torch 2.13 (torchclip
    clips them); from 2.14 it clips them too, and must then agree with torchclip. Asked of the installed torch."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = sparse_grad([1.0], [[0]], (3,))
    try:
        torch.nn.utils.clip_grad_norm_([p], 1.0)
    except NotImplementedError:
        return False
    return True


TORCH_CLIPS_SPARSE = _torch_clips_sparse_gradients()


def test_sparse_gradients_are_clipped_as_torch_clips_them_where_it_does():
    model, _ = embedding_models()
    theirs, _ = embedding_models()
    for m in (model, theirs):
        m(torch.tensor([[1, 2]])).sum().backward()
    if TORCH_CLIPS_SPARSE:
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    else:
        with pytest.raises(NotImplementedError):
            torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    total = torchclip.clip_grad_norm_(model.parameters(), 0.1)
    assert torchclip.get_total_norm([p.grad for p in model.parameters()]).item() == pytest.approx(0.1, rel=1e-5)
    if TORCH_CLIPS_SPARSE:
        torch.testing.assert_close(total, expected)
        for p, q in zip(model.parameters(), theirs.parameters()):
            assert p.grad.is_sparse == q.grad.is_sparse
            torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense())
