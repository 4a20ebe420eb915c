import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _quiet_torch_warnings():
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
