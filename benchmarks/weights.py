"""The initial weights every mode starts from: a PyTorch RoBERTa from the config with seed 0, saved too in Flax's and
(where a mode needs it) TensorFlow's formats, so that each training worker loads its own format and imports no other
framework. A process of its own: `python -m benchmarks.weights SPEC`."""

import json
import os
import sys
from pathlib import Path

from benchmarks.measure import RESULT


def main():
    import torch
    import transformers

    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.manual_seed(0)
    pt_dir = os.path.join(spec["init_dir"], "pytorch")
    config = transformers.AutoConfig.from_pretrained(spec["config_dir"])
    transformers.AutoModelForMaskedLM.from_config(config).save_pretrained(pt_dir)
    for framework, auto in (("flax", "FlaxAutoModelForMaskedLM"), ("tensorflow", "TFAutoModelForMaskedLM")):
        if framework in spec["frameworks"]:
            model = getattr(transformers, auto).from_pretrained(pt_dir, from_pt=True)
            model.save_pretrained(os.path.join(spec["init_dir"], framework))
    print(RESULT + json.dumps({}))


if __name__ == "__main__":
    main()
