"""Pod Security Standards, the "restricted" profile (Kubernetes 1.30), for offline checks.

What the PodSecurity admission controller enforces with
``pod-security.kubernetes.io/enforce: restricted`` (which includes "baseline"), written
out from https://kubernetes.io/docs/concepts/security/pod-security-standards/ for the
pod templates of workload manifests. No package on PyPI implements these checks offline,
so tests/test_k8s.py uses this one; ``violations`` returns what the admission controller
would refuse, one line each.
"""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SECCOMP_ALLOWED = {"RuntimeDefault", "Localhost"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}


def pod_spec(doc: dict) -> dict | None:
    """The pod template of a workload (Deployment, Job, ...), a Pod's spec, or None."""
    if doc.get("kind") == "Pod":
        return doc["spec"]
    template = doc.get("spec", {}).get("template") or doc.get("spec", {}).get(
        "jobTemplate", {}).get("spec", {}).get("template")
    return template.get("spec") if template else None


def violations(pod: dict) -> list[str]:
    """What the restricted profile refuses in this pod spec (empty: it passes)."""
    found = _baseline_pod(pod) + _volumes(pod)
    pod_context = pod.get("securityContext") or {}
    containers = [*pod.get("initContainers", []), *pod.get("containers", []),
                  *pod.get("ephemeralContainers", [])]
    for container in containers:
        found += [f"container {container['name']}: {v}"
                  for v in _container(container, pod_context)]
    return found


def _baseline_pod(pod: dict) -> list[str]:
    found = [f"{key} must not be true" for key in ("hostNetwork", "hostPID", "hostIPC")
             if pod.get(key)]
    context = pod.get("securityContext") or {}
    found += _selinux(context.get("seLinuxOptions"))
    for sysctl in context.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"sysctl {sysctl['name']} is not in the safe set")
    if context.get("runAsUser") == 0:
        found.append("pod runAsUser must not be 0")
    if (context.get("appArmorProfile") or {}).get("type") == "Unconfined":
        found.append("pod appArmorProfile must not be Unconfined")
    if (context.get("seccompProfile") or {}).get("type") not in (None, *SECCOMP_ALLOWED):
        found.append("pod seccompProfile must be RuntimeDefault or Localhost")
    return found


def _volumes(pod: dict) -> list[str]:
    found = []
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: type {sorted(kinds)} is not allowed")
    return found


def _container(container: dict, pod_context: dict) -> list[str]:
    context = container.get("securityContext") or {}
    found = []
    if context.get("privileged"):
        found.append("privileged must not be true")
    if context.get("procMount") not in (None, "Default"):
        found.append("procMount must be Default")
    if any(p.get("hostPort") for p in container.get("ports") or []):
        found.append("hostPort must not be set")
    found += _selinux(context.get("seLinuxOptions"))
    if (context.get("appArmorProfile") or {}).get("type") == "Unconfined":
        found.append("appArmorProfile must not be Unconfined")
    if context.get("allowPrivilegeEscalation") is not False:
        found.append("allowPrivilegeEscalation must be false")
    capabilities = context.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or []):
        found.append("capabilities.drop must include ALL")
    if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
        found.append("capabilities.add may only hold NET_BIND_SERVICE")
    found += _user(context, pod_context)
    seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {})
    if seccomp.get("type") not in SECCOMP_ALLOWED:
        found.append("seccompProfile must be RuntimeDefault or Localhost (here or the pod's)")
    return found


def _user(context: dict, pod_context: dict) -> list[str]:
    found = []
    non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
    if non_root is not True:
        found.append("runAsNonRoot must be true (here or the pod's)")
    if context.get("runAsUser") == 0:
        found.append("runAsUser must not be 0")
    return found


def _selinux(options: Any) -> list[str]:
    if not options:
        return []
    found = []
    if options.get("type") not in SELINUX_TYPES:
        found.append(f"seLinuxOptions.type {options['type']} is not allowed")
    if options.get("user") or options.get("role"):
        found.append("seLinuxOptions.user and .role must not be set")
    return found
