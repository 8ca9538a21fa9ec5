import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(int(os.environ.get("BACKPRISM_TEST_THREADS", "1")))

# Opt-in smoke run of the whole suite on an accelerator: BACKPRISM_TEST_DEVICE=cuda pytest
# makes every tensor created without an explicit device land there. Unset: nothing changes.
if os.environ.get("BACKPRISM_TEST_DEVICE"):
    torch.set_default_device(os.environ["BACKPRISM_TEST_DEVICE"])
