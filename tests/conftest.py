import os
import sys

import torch

# The tests run tiny models: one thread is faster than two, and far faster when another job
# loads the second core (thread hand-offs then stall for whole scheduler slices).
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
