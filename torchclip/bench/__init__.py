"""torchclip's benchmark: torchclip against torch.nn.utils and against the memory bound.

`python -m torchclip.bench` (or `torchclip-bench`) runs it; see __main__.py for the options.
"""
