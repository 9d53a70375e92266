"""The smallest complete DDP training script: what notebook 03 starts from.

Run it with torchrun:

    torchrun --standalone --nproc-per-node 4 minimal.py --data-dir /scratch/data --epochs 2
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from course_utils.data import load_dataset  # torchvision's CIFAR10, or a labelled stand-in


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="data")
    p.add_argument("--download", action="store_true", help="fetch CIFAR-10 (needs internet)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--limit", type=int, default=2048, help="images used from the training set")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, ...
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # this process's GPU, before any CUDA work
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # env://: MASTER_ADDR and MASTER_PORT come from torchrun; device_id binds NCCL to this GPU
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()

    if args.download and rank == 0:  # once, into a --data-dir that every node reads; on a
        load_dataset("cifar10", root=args.data_dir, download=True)  # cluster, stage it instead
    dist.barrier()  # the other ranks wait until the data is there
    data = load_dataset("cifar10", root=args.data_dir, limit=args.limit).dataset
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=64 // world, sampler=sampler, drop_last=True)

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                        nn.Flatten(), nn.Linear(256, 10)).to(device)  # fmt: skip
    model = DDP(net, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients, bucket by bucket, during backward
            opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the last step's loss, averaged over ranks
        if rank == 0:
            print(f"epoch {epoch}: loss {mean.item() / world:.3f} on {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
