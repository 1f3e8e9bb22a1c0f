import os
import sys

import torch

# Tests are sized for 2 CPU cores; keep torch from oversubscribing them.
torch.set_num_threads(min(2, os.cpu_count() or 1))
sys.path.insert(0, os.path.dirname(__file__))
