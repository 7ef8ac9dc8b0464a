#!/usr/bin/env python3
"""DeepSpeedExamples' `training/pipeline_parallelism/train.py`, as its users run it, on zerospeed.

The same calls in the same order as that script (`add_config_arguments`, `init_distributed`,
`runtime.utils.set_random_seed`, a `PipelineModule` over the layers of an AlexNet-shaped network - plain
modules and a lambda - with `loss_fn` and `partition_method="parameters"`, `initialize(args=..., model=...,
model_parameters=..., training_data=...)`, then `engine.train_batch()` with no iterator; or, at
`--pipeline-parallel-size 0`, the data-parallel engine with `RepeatingLoader` over the returned loader). Only
the import lines name zerospeed, and two things this CPU machine cannot do are replaced: torchvision's AlexNet
and CIFAR-10 download become a small network of the same layout and a random CIFAR-shaped dataset, and
`torch.cuda.set_device` is left out. `--out` (added) writes every rank's per-step losses as JSON.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import zerospeed as deepspeed
from zerospeed.pipe import PipelineModule
from zerospeed.utils import RepeatingLoader


class AlexNet(nn.Module):
    """torchvision's AlexNet layout (features, avgpool, classifier), small enough for a CPU test."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 16, kernel_size=3, padding=1), nn.ReLU(inplace=True))
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Dropout(p=0.0), nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True),
                                        nn.Linear(32, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def cifar_trainset(n=64, seed=5):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 16, 16, generator=g)
    return torch.utils.data.TensorDataset(images, torch.randint(0, 10, (n,), generator=g))


def get_args():
    parser = argparse.ArgumentParser(description='CIFAR')
    parser.add_argument('--local_rank', type=int, default=-1, help='local rank passed from distributed launcher')
    parser.add_argument('-s', '--steps', type=int, default=100, help='quit after this many steps')
    parser.add_argument('-p', '--pipeline-parallel-size', type=int, default=2, help='pipeline parallelism')
    parser.add_argument('--backend', type=str, default='gloo', help='distributed backend')
    parser.add_argument('--seed', type=int, default=1138, help='PRNG seed')
    parser.add_argument('--out', type=str, required=True, help='where to write the losses (JSON)')
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train_base(args):
    torch.manual_seed(args.seed)
    net = AlexNet(num_classes=10)
    trainset = cifar_trainset()
    engine, _, dataloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    dataloader = RepeatingLoader(dataloader)
    data_iter = iter(dataloader)
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for micro_step in range(args.steps * engine.gradient_accumulation_steps()):
        batch = next(data_iter)
        inputs = batch[0].to(engine.device)
        labels = batch[1].to(engine.device)
        outputs = engine(inputs)
        loss = criterion(outputs, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def join_layers(vision_model):
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]


def train_pipe(args, part='parameters'):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = AlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)
    trainset = cifar_trainset()
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    return [engine.train_batch().item() for _ in range(args.steps)]


if __name__ == '__main__':
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ['LOCAL_RANK'])
    losses = train_base(args) if args.pipeline_parallel_size == 0 else train_pipe(args)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(losses, f)
