"""All-reduce of R replica buffers: dpcuda's algorithms (one_shot, two_shot, ring) against the
host-staged scheme (every buffer to host memory, summed there, copied back), torch's
equivalent in device memory (torch.stack(...).sum(0) copied into every replica), on CUDA
torch.cuda.comm.reduce_add + broadcast_coalesced (what nn.DataParallel does), and
torch.distributed's all_reduce with R processes (gloo on the CPU; NCCL needs one GPU per
process, so it runs only where there are R GPUs). Replicas share
the device (devices may repeat), so besides time and algorithm bandwidth (S / t) it reports
bytes moved (2 R S: every buffer read once and written once) over the device's measured copy
bandwidth.

    python benchmarks/bench_allreduce.py --device cpu --json benchmarks/results/allreduce-cpu.json
"""

import argparse
import os
import socket
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import compare_ms, environment, time_ms, write_json  # noqa: E402

import dpcuda  # noqa: E402
from dpcuda import parallel  # noqa: E402

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]


def copy_bandwidth(device):
    """Bytes per second of a device-memory copy (read + write counted), 64 MiB."""
    src = torch.empty(16 << 20, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, repeats=10)
    return 2 * src.nbytes / (ms / 1e3)


def host_staged(ts):
    host = [t.to("cpu", copy=True) for t in ts]
    total = host[0]
    for h in host[1:]:
        total = total + h
    for t in ts:
        t.copy_(total)


def torch_device_sum(ts):
    total = torch.stack(ts).sum(0)
    for t in ts:
        t.copy_(total)


def _dist_worker(rank, world, port, device, sizes, repeats, out_dir):
    import statistics
    import time

    import torch.distributed as dist
    torch.set_num_threads(1)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dev = f"cuda:{rank}" if backend == "nccl" else "cpu"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        times = {}
        for size in sizes:
            t = torch.randn(size // 4, device=dev)
            samples = []
            for i in range(repeats + 2):
                dist.barrier()
                if backend == "nccl":
                    torch.cuda.synchronize(dev)
                start = time.perf_counter()
                dist.all_reduce(t)
                if backend == "nccl":
                    torch.cuda.synchronize(dev)
                if i >= 2:
                    samples.append((time.perf_counter() - start) * 1e3)
            times[size] = statistics.median(samples)
        if rank == 0:
            torch.save(times, os.path.join(out_dir, "dist.pt"))
    finally:
        dist.destroy_process_group()


def dist_times(world, device, sizes, repeats):
    """Median ms of torch.distributed.all_reduce with `world` processes, per size; None where
    the backend cannot run here."""
    if device.startswith("cuda") and torch.cuda.device_count() < world:
        return None
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_dist_worker, args=(world, port, device, sizes, repeats, out), nprocs=world,
                 join=True)
        return torch.load(os.path.join(out, "dist.pt"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if dpcuda.cuda_available() else "cpu")
    parser.add_argument("--replicas", default="2,4,8")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="largest buffer (default 256 MiB on CUDA, 64 MiB on the CPU)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = args.device
    cuda = device.startswith("cuda")
    max_bytes = args.max_bytes or ((256 << 20) if cuda else (64 << 20))
    bw = copy_bandwidth(device)
    print(f"device copy bandwidth: {bw / 1e9:.1f} GB/s")
    rows = []
    header = f"{'R':>3}{'size':>10}{'method':>14}{'ms':>10}{'algbw GB/s':>12}{'% copy bw':>11}"
    print(header)
    sizes = [s for s in SIZES if s <= max_bytes]
    for R in [int(r) for r in args.replicas.split(",")]:
        dist_ms = dist_times(R, device, sizes, args.repeats or 5)
        for size in sizes:
            n = size // 4
            ts = [torch.randn(n, device=device) for _ in range(R)]
            fns = {a: (lambda a=a: parallel.all_reduce(ts, algorithm=a))
                   for a in ("one_shot", "two_shot", "ring")}
            fns["host_staged"] = lambda: host_staged(ts)
            fns["torch_sum"] = lambda: torch_device_sum(ts)
            if cuda:
                import torch.cuda.comm as comm

                def dp_style():
                    total = comm.reduce_add(ts, destination=ts[0].get_device())
                    targets = [t.get_device() for t in ts]
                    if len(set(targets)) == len(targets):
                        copies = [c[0] for c in comm.broadcast_coalesced([total], targets)]
                    else:  # replicas sharing a device: broadcast_coalesced wants distinct ones
                        copies = [total] * len(ts)
                    for t, c in zip(ts, copies):
                        t.copy_(c)
                fns["cuda_comm"] = dp_style
            big = size >= (16 << 20)
            repeats = args.repeats or (5 if big else 20)
            times = compare_ms(fns, device, warmup=1 if big else 3, repeats=repeats)
            if dist_ms is not None:
                times["torch_dist"] = dist_ms[size]
            for name, ms in times.items():
                moved = 2 * R * size
                row = {"replicas": R, "bytes": size, "method": name, "ms": ms,
                       "algbw_gbs": size / (ms / 1e3) / 1e9,
                       "fraction_of_copy_bw": moved / (ms / 1e3) / bw}
                rows.append(row)
                print(f"{R:>3}{size:>10}{name:>14}{ms:>10.3f}{row['algbw_gbs']:>12.2f}"
                      f"{100 * row['fraction_of_copy_bw']:>10.0f}%", flush=True)
            del ts
    write_json(args.json, {"benchmark": "allreduce", "copy_bandwidth_gbs": bw / 1e9,
                           "environment": environment(device), "results": rows})


if __name__ == "__main__":
    main()
