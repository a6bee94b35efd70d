"""What the WAL written over a few seconds holds, by relation: MB, records, full page images, distinct pages.

Run beside a benchmark (bench_soak.py) on the machine of the PostgreSQL server, as a user that can read its
data directory: it reads the WAL position, waits, reads it again, copies the segments between the two before a
checkpoint recycles them, and reads them with pg_waldump. A checkpoint that ends within the window can remove
segments first (pg_waldump then says which is missing): keep the window short and try again.

    .venv/bin/python bench/wal_by_relation.py --seconds 5 --schema 'adp_soak%'
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

RECORD = re.compile(r"len \(rec/tot\):\s*\d+/\s*(\d+)")
BLOCK = re.compile(r"rel \d+/\d+/(\d+)(?: fork \w+)? blk (\d+)( FPW)?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--schema", default="adp_%", help="LIKE pattern of the schemas whose relations are named")
    args = parser.parse_args()
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        q = lambda sql, *a: conn.execute(sql, a).fetchone()[0]  # noqa: E731
        wal = Path(q("SHOW data_directory")) / "pg_wal"
        bindir = Path(q("SELECT setting FROM pg_config WHERE name = 'BINDIR'"))
        start = q("SELECT pg_current_wal_lsn()::text")
        time.sleep(args.seconds)
        end = q("SELECT pg_current_wal_lsn()::text")
        q("SELECT pg_switch_wal()::text")  # the last segment complete on disk
        # Through the segment now written: pg_waldump reads the one after the end's to finish its last record.
        first, last = q("SELECT pg_walfile_name(%s)", start), q("SELECT pg_walfile_name(pg_current_wal_lsn())")
        names = dict(conn.execute("SELECT c.relfilenode::text, n.nspname || '.' || c.relname FROM pg_class c JOIN "
                                  "pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname LIKE %s",
                                  [args.schema]).fetchall())
    with tempfile.TemporaryDirectory() as copy:
        for segment in sorted(wal.glob("[0-9A-F]" * 24)):
            if first <= segment.name <= last:
                shutil.copy(segment, copy)
        dump = subprocess.run([str(bindir / "pg_waldump"), "-p", copy, "-s", start, "-e", end],
                              capture_output=True, text=True, errors="replace")
    if dump.returncode and not dump.stdout:
        raise SystemExit(f"pg_waldump failed (a checkpoint may have removed a segment; try again): "
                         f"{dump.stderr.strip()}")
    size, records, fpw = collections.Counter(), collections.Counter(), collections.Counter()
    pages: dict[str, set] = collections.defaultdict(set)
    for line in dump.stdout.splitlines():
        if not (m := RECORD.search(line)):
            continue
        blocks = BLOCK.findall(line)
        first_rel = names.get(blocks[0][0], f"other {blocks[0][0]}") if blocks else f"({line.split()[1]})"
        size[first_rel] += int(m.group(1))
        records[first_rel] += 1
        for rel, block, full in blocks:
            name = names.get(rel, f"other {rel}")
            fpw[name] += bool(full)
            pages[name].add(block)
    print(f"WAL {start} .. {end} over {args.seconds:g} s: {sum(size.values()) / 2**20:.1f} MB, "
          f"{sum(fpw.values()):,} full page images")
    print("| relation | MB | records | full page images | distinct pages |\n|---|---:|---:|---:|---:|")
    for name, total in size.most_common(15):
        print(f"| {name} | {total / 2**20:.1f} | {records[name]:,} | {fpw[name]:,} | {len(pages[name]):,} |")


if __name__ == "__main__":
    main()
