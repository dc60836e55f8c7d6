#!/usr/bin/env python3
# SPDX-License-Identifier: ISC
"""examples/n8n/apply-settings.py: the one place for the kit's settings.

n8n's community edition has no variables shared between workflows, so
every workflow of the kit starts with a Config node (approval.json has two,
one per webhook), and a URL such as approval_page_url appears in several of
them.  Keep your values in ONE JSON file (start from settings.json, which
holds the defaults the workflow files ship with) and let this script write
them into every Config node, into copies ready for `n8n import:workflow`:

  python3 examples/n8n/apply-settings.py my-settings.json OUTDIR
  n8n import:workflow --separate --input=OUTDIR

Keys you leave out keep the workflow's default; an unknown key, or a value
of the wrong type (a number where the node holds a number), is refused, so
a typo cannot leave one workflow behind.  To change a setting later, edit
the file, run this again and re-import: a workflow imported with the same
id replaces the earlier one.  Python 3 standard library only.
"""
import glob
import json
import os
import sys

KIT = os.path.dirname(os.path.abspath(__file__))


def config_nodes(wf):
    return [n for n in wf["nodes"]
            if n["type"] == "n8n-nodes-base.set" and n["name"].startswith("Config")]


def workflows():
    out = {}
    for path in sorted(glob.glob(os.path.join(KIT, "*.json"))):
        if os.path.basename(path) == "settings.json":
            continue
        with open(path) as f:
            out[os.path.basename(path)] = json.load(f)
    return out


def apply(settings, wfs):
    """Writes settings into the Config nodes of wfs (in place).  Returns
    {key: [file, ...]} of where each key went; raises ValueError on an
    unknown key or a wrong type."""
    where = {}
    for name, wf in wfs.items():
        for n in config_nodes(wf):
            for a in n["parameters"]["assignments"]["assignments"]:
                if a["name"] not in settings:
                    continue
                v = settings[a["name"]]
                if a["type"] == "number":
                    if isinstance(v, bool) or not isinstance(v, (int, float)):
                        raise ValueError(f"{a['name']}: must be a number (got {v!r})")
                elif not isinstance(v, str):
                    raise ValueError(f"{a['name']}: must be a string (got {v!r})")
                a["value"] = v
                where.setdefault(a["name"], [])
                if name not in where[a["name"]]:
                    where[a["name"]].append(name)
    unknown = sorted(set(settings) - set(where))
    if unknown:
        raise ValueError("unknown setting(s): " + ", ".join(unknown)
                         + " (the keys are those of examples/n8n/settings.json)")
    return where


def main(argv):
    if len(argv) != 3 or argv[1] in ("-h", "--help"):
        sys.stderr.write(__doc__)
        return 2
    with open(argv[1]) as f:
        settings = json.load(f)
    if not isinstance(settings, dict):
        sys.stderr.write("apply-settings: the settings file must hold one JSON object\n")
        return 2
    settings = {k: v for k, v in settings.items() if not k.startswith("_")}
    wfs = workflows()
    try:
        where = apply(settings, wfs)
    except ValueError as e:
        sys.stderr.write(f"apply-settings: {argv[1]}: {e}\n")
        return 1
    os.makedirs(argv[2], exist_ok=True)
    for name, wf in wfs.items():
        with open(os.path.join(argv[2], name), "w") as f:
            json.dump(wf, f, indent=1)
            f.write("\n")
    for k in sorted(where):
        print(f"{k}: {', '.join(where[k])}")
    print(f"wrote {len(wfs)} workflows to {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
