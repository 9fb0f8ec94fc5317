"""LAMB on Fashion-MNIST: the Adam optimizer becomes LAMB, Adam's update rescaled per layer by
``||w|| / ||update||``; biases get no weight decay and, as in Paddle, no rescaling.

    fleetrun --nproc_per_node 2 examples/strategies/lamb.py
"""
import torch

import common
from fleetx import fleet

args = common.parse_args(__doc__.splitlines()[0], lr=0.01, batch_size=256)
strategy = fleet.DistributedStrategy()
strategy.lamb = True
strategy.lamb_configs = {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": ["bias"]}
common.train(args, strategy, lambda params: torch.optim.Adam(params, lr=args.lr))
