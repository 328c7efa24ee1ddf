import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
# find header
hi = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
h = rows[hi]; data = rows[hi + 1:]
ki, mi, vi = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value")
per = collections.OrderedDict()
seq = []
for r in data:
    if len(r) <= vi: continue
    if r[mi] != "gpu__time_duration.sum": continue
    name = r[ki].split("(")[0].split("<")[0][:40] + ("<" + r[ki].split("<")[1].split(">")[0] + ">" if "<" in r[ki] else "")
    v = float(r[vi].replace(",", ""))
    seq.append((name, v))
    a = per.setdefault(name, [0, 0.0]); a[0] += 1; a[1] += v
tot = sum(v for _, v in seq)
print(f"kernels {len(seq)} total {tot/1e3:.1f} us (unit as reported)")
for n, (c, s) in sorted(per.items(), key=lambda x: -x[1][1]):
    print(f"{n:70s} n={c:4d} sum={s:10.0f} mean={s/c:8.0f}")
print("first layer sequence:", [(n[:30], round(v)) for n, v in seq[:12]])
