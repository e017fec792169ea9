"""Adaptive clipping: clips whose threshold follows the run, on torchclip's kernels.

* zscore: ClipGradByZScore, ZClip (the global norm against an EMA of its mean and variance)
* quantile: ClipGradByQuantile, AutoClip (each norm against a quantile of the norms seen so far)
* norm_ema: ClipGradByNormEMA, AdaGC (each tensor against an EMA of its own clipped norms)
* spike: SkipStepOnSpike, OLMo-core's spike skip (the optimizer step skipped on a global-norm spike)
* unitwise: ClipGradByUnitwiseNorm, AGC (each output unit against its weights' norm; no state)
* _state: what they share (statistics on the gradients' device, state_dict, the nonfinite policy,
  per-parameter rows)
"""

# Pickles of a clip (torch.save of an optimizer with its clips) name the row table and the sorted window by
# the path torchclip 0.1.0 gave them, torchclip.adaptive._ParamRows and ._SortedWindow: they load from here.
from torchclip.adaptive._state import _ParamRows as _ParamRows
from torchclip.adaptive.norm_ema import ClipGradByNormEMA
from torchclip.adaptive.quantile import ClipGradByQuantile
from torchclip.adaptive.quantile import _SortedWindow as _SortedWindow
from torchclip.adaptive.spike import SkipStepOnSpike
from torchclip.adaptive.unitwise import ClipGradByUnitwiseNorm
from torchclip.adaptive.zscore import ClipGradByZScore

__all__ = ["ClipGradByNormEMA", "ClipGradByQuantile", "ClipGradByUnitwiseNorm", "ClipGradByZScore", "SkipStepOnSpike"]
