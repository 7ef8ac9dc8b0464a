#!/usr/bin/env python3
"""DeepSpeedExamples' `training/gan/gan_deepspeed_train.py`, as its users run it, on zerospeed.

The same training loop: two engines in one process (`initialize(args=..., model=netD / netG, model_parameters=...,
optimizer=client Adam)`, the config file's own Adam block beside them), the modules called directly (`netD(real)`,
not the engine), two `model_engineD.backward(...)` per `model_engineD.step()` (real, then fake), the generator's
backward through the discriminator, a plain (not distributed) shuffled DataLoader seeded alike on every rank. Only
the import lines name zerospeed. Changed for this machine: the DCGAN convolution nets and the image datasets
(torchvision) become two small MLPs and random "images" of 12 values; no tensorboard or image files; `--out`
(added) writes every rank's per-step losses as JSON.
"""
import json
import os
import random

import torch
import torch.nn as nn

import zerospeed as deepspeed


def get_argument_parser():
    import argparse
    parser = argparse.ArgumentParser(description="GAN")
    parser.add_argument('--batchSize', type=int, default=8, help='input batch size')
    parser.add_argument('--nz', type=int, default=8, help='size of the latent z vector')
    parser.add_argument('--epochs', type=int, default=1, help='number of epochs to train for')
    parser.add_argument('--lr', type=float, default=0.002, help='learning rate')
    parser.add_argument('--beta1', type=float, default=0.5, help='beta1 for adam. default=0.5')
    parser.add_argument('--manualSeed', type=int, default=999, help='manual seed')
    parser.add_argument("--local_rank", type=int, default=-1, help="local_rank for distributed training on gpus")
    parser.add_argument("--out", type=str, default=None)
    return parser


def set_seed(value):
    random.seed(value)
    torch.manual_seed(value)


def build(nz):
    netG = nn.Sequential(nn.Linear(nz, 16), nn.ReLU(True), nn.Linear(16, 12), nn.Tanh())
    netD = nn.Sequential(nn.Linear(12, 16), nn.LeakyReLU(0.2, inplace=True), nn.Linear(16, 1), nn.Sigmoid())
    return netG, netD


def dataset():
    return torch.utils.data.TensorDataset(torch.randn(64, 12))


def train(args):
    set_seed(args.manualSeed)
    dataloader = torch.utils.data.DataLoader(dataset(), batch_size=args.batchSize, shuffle=True)
    nz = int(args.nz)
    netG, netD = build(nz)
    criterion = nn.BCELoss()
    real_label = 1
    fake_label = 0
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    model_engineD, optimizerD, _, _ = deepspeed.initialize(args=args, model=netD, model_parameters=netD.parameters(), optimizer=optimizerD)
    model_engineG, optimizerG, _, _ = deepspeed.initialize(args=args, model=netG, model_parameters=netG.parameters(), optimizer=optimizerG)
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(dataloader, 0):
            netD.zero_grad()
            real = data[0]
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, dtype=real.dtype)
            output = netD(real).view(-1)
            errD_real = criterion(output, label)
            model_engineD.backward(errD_real)
            noise = torch.randn(batch_size, nz)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach()).view(-1)
            errD_fake = criterion(output, label)
            model_engineD.backward(errD_fake)
            model_engineD.step()
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake).view(-1)
            errG = criterion(output, label)
            model_engineG.backward(errG)
            model_engineG.step()
            losses.append([errD_real.item(), errD_fake.item(), errG.item()])
    if args.out:
        with open(os.path.join(args.out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
            json.dump(losses, f)


def main():
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    train(args)


if __name__ == "__main__":
    main()
