"""Sample indices computed, not stored: what a rank needs to find sample k of a run's data
without a Python list per sample (no torch; numpy only).

- `feistel.Permutation`: a seekable pseudo-random permutation of [0, n) (an epoch's shuffle).
- `blend.Blend`: which source sample k of a weighted mixture comes from, and its number there.
- `windows`: the seq_len windows of one source's token stream, its validation holdout, and
  the document positions of a window (`dataset.packing=documents`).
"""

from loom.data.index.blend import Blend
from loom.data.index.feistel import Permutation
from loom.data.index.windows import Holdout, window_positions

__all__ = ["Blend", "Holdout", "Permutation", "window_positions"]
