"""Zero the payload of every fatbin entry whose arch is not in KEEP (headers kept) in an ELF .so, in place.

    python prune_fatbin.py libonnxruntime_providers_cuda.so 90
"""

import re
import struct
import subprocess
import sys
from pathlib import Path

path, keep = sys.argv[1], {int(a) for a in sys.argv[2].split(",")}
out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True).stdout
m = re.search(r"\.nv_fatbin\s+PROGBITS\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)", out)
OFF, SIZE = int(m.group(1), 16), int(m.group(2), 16)
data = bytearray(Path(path).read_bytes())
pos, end = OFF, OFF + SIZE
zeroed = kept = 0
while pos < end:
    magic, ver, hsz, fsz = struct.unpack_from("<IHHQ", data, pos)
    if magic != 0xBA55ED50:  # padding between fatbins
        pos += 8
        continue
    e = pos + hsz
    bend = pos + hsz + fsz
    while e < bend:
        kind, unk, ehsz, psz = struct.unpack_from("<HHIQ", data, e)
        arch = struct.unpack_from("<I", data, e + 28)[0]
        if arch in keep:
            kept += psz
        else:
            data[e + ehsz: e + ehsz + psz] = bytes(psz)
            zeroed += psz
        e += ehsz + psz
    pos = bend
Path(path).write_bytes(data)
print(f"kept {kept / 1e6:.1f} MB, zeroed {zeroed / 1e6:.1f} MB")
