"""What the s3:// tests share: a boto3 client of the loopback server, listings, and a small state
saved and checked bit-exactly under another split (the fixtures are in this folder's conftest.py)."""

import json

import boto3
import torch

import lightning_distckpt as ldc


def client(endpoint):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def keys(endpoint, bucket):
    listed = client(endpoint).list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def marker(endpoint, bucket, prefix):
    return json.loads(client(endpoint).get_object(Bucket=bucket, Key=f"{prefix}/COMMITTED")["Body"].read())


def full_values(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 6, generator=g), "h": torch.randn(4, 5, generator=g).to(torch.bfloat16),
            "n": torch.arange(7, dtype=torch.int64) * seed}


def state(seed, rank=0, world=1):
    """Rows of ``w`` and ``h`` split over the ranks; ``n`` replicated; an object per rank; common."""
    full = full_values(seed)
    sd = {
        "w": ldc.ShardedTensor.from_rank_offsets("w", full["w"].chunk(world)[rank].clone(), (0, rank, world)),
        "h": ldc.ShardedTensor.from_rank_offsets("h", full["h"].chunk(world)[rank].clone(), (0, rank, world)),
        "n": ldc.ShardedTensor.from_rank_offsets("n", full["n"].clone(), replica_id=rank),
        "obj": ldc.ShardedObject("obj", {"rank": rank, "seed": seed}, (world,), (rank,)),
        "step": seed,
    }
    return sd


def template(rank=0, world=1):
    """Columns of ``w`` split over the ranks (a resharding load), ``h`` whole."""
    full = full_values(0)
    cols = full["w"].chunk(world, dim=1)[rank]
    return {
        "w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros_like(cols), (1, rank, world)),
        "h": ldc.ShardedTensor.from_rank_offsets("h", torch.zeros_like(full["h"]), replica_id=rank),
        "n": ldc.ShardedTensor.from_rank_offsets("n", torch.zeros(7, dtype=torch.int64), replica_id=rank),
        "obj": ldc.ShardedObject("obj", None, (world,), (rank,)),
    }


def check(out, seed, rank=0, world=1):
    full = full_values(seed)
    assert torch.equal(out["w"], full["w"].chunk(world, dim=1)[rank])
    assert torch.equal(out["h"].view(torch.int16), full["h"].view(torch.int16))  # bit-exact bfloat16
    assert torch.equal(out["n"], full["n"])
    assert out["obj"] == {"rank": rank, "seed": seed} and out["step"] == seed


def save_and_load_errors(rank, world, url):
    """On each rank: the CheckpointingError texts of a save to ``url`` and of a load from it (for
    endpoints or buckets where both must fail with one clear error on every rank)."""
    import lightning_distckpt as ldc
    from lightning_distckpt.core.errors import CheckpointingError

    errors = []
    for call in (lambda: ldc.save(state(1, rank, world), url), lambda: ldc.load(template(rank, world), url)):
        try:
            call()
        except CheckpointingError as e:
            errors.append(str(e))
    return errors
