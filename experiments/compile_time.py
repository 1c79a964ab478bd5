"""How long the first compiled calls take on the embedded pair: StaticTarget(compile=True)'s warm-up and
the first round of drafter.compile(dynamic=True), as the lines they print on a terminal say.

    script -qc "python experiments/compile_time.py" /dev/null                                  # cache as it is
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) script -qc "python experiments/compile_time.py" /dev/null   # cold

(`script` gives the process a terminal: off one the compile lines are silent.)
"""

import torch

from dflash2 import StaticTarget, spec_generate
from dflash2.embedded import load_embedded

if __name__ == "__main__":
    tokenizer, target, drafter = load_embedded("dflash2")
    ids = tokenizer('import os\n\n\ndef walk_files(top, suffix=".py"):\n', return_tensors="pt").input_ids
    drafter.compile(dynamic=True)
    fast = StaticTarget(target, drafter.target_layer_ids, compile=True)
    out = spec_generate(drafter, fast, ids, max_new_tokens=64, verify="tree", tree_nodes=15)
    assert torch.equal(out.sequences, spec_generate(drafter, target, ids, max_new_tokens=64).sequences)
    print(f"tau {out.tau:.2f} (the compiled pair decodes as the plain one)")
