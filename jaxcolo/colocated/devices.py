"""``colocated_cpu_devices``: the CPU devices on the hosts of given devices."""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np


@functools.lru_cache(maxsize=1024)
def _cpu_devices_for(devices: tuple) -> tuple:
    out = []
    if all(d.platform == "cpu" for d in devices):
        return devices
    by_colocation = collections.defaultdict(list)
    for d in devices[0].client._get_all_devices():
        if d.device_kind == "cpu":
            by_colocation[getattr(d, "colocation_id", None)].append(d)
    by_process = collections.defaultdict(list)
    for d in jax.devices("cpu"):
        by_process[d.process_index].append(d)
    used = collections.Counter()
    for d in devices:
        if d.platform == "cpu":
            out.append(d)
            continue
        match = by_colocation.get(getattr(d, "colocation_id", None), [])
        if len(match) == 1:
            out.append(match[0])
            continue
        # No colocation ids: the CPU devices of the device's process, in order.
        local = by_process.get(d.process_index, [])
        k = used[d.process_index]
        if k >= len(local):
            raise ValueError(f"Process {d.process_index} does not have enough "
                             "local CPU devices")
        used[d.process_index] += 1
        out.append(local[k])
    return tuple(out)


def colocated_cpu_devices(devices_or_mesh):
    """CPU devices colocated with ``devices_or_mesh`` (a sequence of devices,
    or a Mesh, for which a same-shaped Mesh of CPU devices is returned).
    Order is preserved; CPU devices map to themselves."""
    if isinstance(devices_or_mesh, jax.sharding.Mesh):
        mesh = devices_or_mesh
        flat = _cpu_devices_for(tuple(mesh.devices.flat))
        if flat == tuple(mesh.devices.flat):
            return mesh
        return jax.sharding.Mesh(np.array(flat).reshape(mesh.devices.shape),
                                 mesh.axis_names, axis_types=mesh.axis_types)
    devices = tuple(devices_or_mesh)
    if not devices:
        return devices
    return _cpu_devices_for(devices)
