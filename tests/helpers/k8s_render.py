"""A tiny kustomize for deploy/k8s: the fields its kustomization.yaml uses, no more.

The tests render with this so they need no kustomize binary; where `kubectl kustomize`
is installed, tests/test_k8s.py checks both renders are the same.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PersistentVolume", "StorageClass"}


def render(folder: Path) -> list[dict]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise ValueError(f"kustomization fields this renderer does not know: {sorted(unknown)}")
    docs = []
    for name in spec.get("resources", []):
        docs += [d for d in yaml.safe_load_all((folder / name).read_text()) if d]
    return [_transform(d, spec) for d in docs]


def _transform(doc: dict, spec: dict) -> dict:
    doc = copy.deepcopy(doc)
    meta = doc.setdefault("metadata", {})
    if "namespace" in spec and doc["kind"] not in CLUSTER_SCOPED:
        meta["namespace"] = spec["namespace"]
    for entry in spec.get("labels", []):
        if entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise ValueError("labels with includeSelectors/includeTemplates are not supported")
        meta.setdefault("labels", {}).update(entry["pairs"])
    for pod in _pod_specs(doc):
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            for image in spec.get("images", []):
                if container["image"].split(":")[0] == image["name"]:
                    container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return doc


def _pod_specs(doc: dict) -> list[dict]:
    template = doc.get("spec", {}).get("template", {})
    return [template["spec"]] if "spec" in template else []
