"""The examples ``shardpoint bench --help`` shows (kept out of the bench's own module)."""

__all__ = ["BENCH_EXAMPLES"]

BENCH_EXAMPLES = """examples:
  shardpoint bench                                # 256 MB on 2 ranks, /dev/shm and the current directory
  shardpoint bench --size 2GB --ranks 4 --dir /mnt/nvme
  shardpoint bench --shapes many-small --ranks 1  # 10,000 small tensors against torch.save/torch.load
  shardpoint bench --scale 2,4,8                  # coordination cost against plain DCP
  shardpoint bench --frozen-base                  # a LoRA-like fine-tune, frozen base stored once or not
  shardpoint bench --store s3 --json              # S3 clients on a loopback server
"""
