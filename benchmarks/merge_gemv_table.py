"""Merge the entries of a ``memra bench census --tune --table-out NEW`` table into a configuration
table (default memra/kernels/gemv_configs.json), keeping every other entry; the note records the
merge. Usage: ``python3 benchmarks/merge_gemv_table.py NEW [BASE]``"""

from __future__ import annotations

import json
import sys

from memra.bench.census import write_config_table


def main() -> None:
    new_path = sys.argv[1]
    base_path = sys.argv[2] if len(sys.argv) > 2 else "memra/kernels/gemv_configs.json"
    base, new = json.load(open(base_path)), json.load(open(new_path))
    write_config_table(base_path, base["configs"] | new["configs"], base["device"],
                       f"{base['note']}; {len(new['configs'])} entries merged from: {new['note']}")
    print(f"merged {len(new['configs'])} entries into {base_path}")


if __name__ == "__main__":
    main()
