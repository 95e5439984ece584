"""Merge the entries of a ``memra bench census --tune --table-out NEW`` table into a configuration
table (default memra/kernels/gemv_configs.json), keeping every other entry; the note records the
merge. Usage: ``python3 benchmarks/merge_gemv_table.py NEW [BASE]``"""

from __future__ import annotations

import json
import sys


def main() -> None:
    new_path = sys.argv[1]
    base_path = sys.argv[2] if len(sys.argv) > 2 else "memra/kernels/gemv_configs.json"
    base, new = json.load(open(base_path)), json.load(open(new_path))
    base["configs"].update(new["configs"])
    base["note"] += f"; {len(new['configs'])} entries merged from: {new['note']}"
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(base["configs"].items()))
    with open(base_path, "w") as f:
        f.write(f'{{\n "note": {json.dumps(base["note"])},\n "device": {json.dumps(base["device"])},\n'
                f' "configs": {{\n{body}\n }}\n}}\n')
    print(f"merged {len(new['configs'])} entries into {base_path}")


if __name__ == "__main__":
    main()
