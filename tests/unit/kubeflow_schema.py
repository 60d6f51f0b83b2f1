"""The part of Kubeflow's CRD schemas that `shardtune k8s` manifests use, and a small validator for it.

Written from the CRDs' openAPIV3Schema: training-operator v1.9.0 manifests/base/crds/kubeflow.org_pytorchjobs.yaml
(PyTorchJob) and trainer v2.3.0 manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml (TrainJob), cut down to the
fields a manifest of ours may contain: an unknown field (a typo, a field of another version) fails validation.
``validate`` also accepts a full CRD's openAPIV3Schema (tests/unit/test_kubernetes_launch.py runs that when
SHARDTUNE_KUBEFLOW_CRDS names a folder with the two CRD files).
"""

from __future__ import annotations

from typing import Any

STRING, INT, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}


def obj(required: list[str] | None = None, **properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **({"required": required} if required else {})}


def array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


METADATA = obj(["name"], name=STRING, namespace=STRING)
RESOURCES = obj(limits={"type": "object", "additionalProperties": QUANTITY},
                requests={"type": "object", "additionalProperties": QUANTITY})
ENV = array(obj(["name"], name=STRING, value=STRING))
VOLUME_MOUNT = obj(["mountPath", "name"], mountPath=STRING, name=STRING, readOnly=BOOL, subPath=STRING)
VOLUME = obj(["name"], name=STRING, configMap=obj(name=STRING, optional=BOOL),
             persistentVolumeClaim=obj(["claimName"], claimName=STRING, readOnly=BOOL),
             emptyDir=obj(medium=STRING, sizeLimit=QUANTITY))
CONTAINER = obj(["name"], name=STRING, image=STRING, command=array(STRING), args=array(STRING), env=ENV,
                resources=RESOURCES, volumeMounts=array(VOLUME_MOUNT))
POD_SPEC = obj(["containers"], containers=array(CONTAINER), volumes=array(VOLUME), terminationGracePeriodSeconds=INT)
REPLICA = obj(replicas=INT, restartPolicy={"type": "string", "enum": ["Always", "OnFailure", "Never", "ExitCode"]},
              template=obj(spec=POD_SPEC))

PYTORCHJOB = obj(
    ["apiVersion", "kind", "metadata", "spec"], apiVersion={"type": "string", "enum": ["kubeflow.org/v1"]},
    kind={"type": "string", "enum": ["PyTorchJob"]}, metadata=METADATA,
    spec=obj(["pytorchReplicaSpecs"], nprocPerNode=STRING,
             pytorchReplicaSpecs={"type": "object", "additionalProperties": REPLICA}),
)

PATCH_CONTAINER = obj(["name"], name=STRING, env=ENV, volumeMounts=array(VOLUME_MOUNT))
PATCH_POD = obj(volumes=array(VOLUME), containers=array(PATCH_CONTAINER), terminationGracePeriodSeconds=INT)
REPLICATED_JOB = obj(["name"], name=STRING, template=obj(spec=obj(template=obj(spec=PATCH_POD))))
TRAINJOB = obj(
    ["apiVersion", "kind", "metadata", "spec"],
    apiVersion={"type": "string", "enum": ["trainer.kubeflow.org/v1alpha1"]},
    kind={"type": "string", "enum": ["TrainJob"]}, metadata=METADATA,
    spec=obj(
        ["runtimeRef"], runtimeRef=obj(["name"], name={"type": "string", "minLength": 1}, kind=STRING),
        trainer=obj(image=STRING, command=array(STRING), args=array(STRING), env=ENV, numNodes=INT,
                    numProcPerNode=INT, resourcesPerNode=RESOURCES),
        runtimePatches=array(obj(["manager"], manager={"type": "string", "minLength": 1},
                                 trainingRuntimeSpec=obj(template=obj(spec=obj(
                                     replicatedJobs=array(REPLICATED_JOB))))))),
)

CONFIGMAP = obj(["apiVersion", "kind", "metadata"], apiVersion={"type": "string", "enum": ["v1"]},
                kind={"type": "string", "enum": ["ConfigMap"]}, metadata=METADATA,
                data={"type": "object", "additionalProperties": STRING})

SCHEMAS = {"PyTorchJob": PYTORCHJOB, "TrainJob": TRAINJOB, "ConfigMap": CONFIGMAP}


def validate(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every place where ``value`` breaks ``schema`` (a structural OpenAPI v3 schema as CRDs use), as paths."""
    if "anyOf" in schema and not schema.get("x-kubernetes-int-or-string"):
        return [] if any(not validate(value, option, path) for option in schema["anyOf"]) else [f"{path}: no match"]
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
        return [] if ok else [f"{path}: {value!r} is neither an integer nor a string"]
    problems = _type_problems(value, schema, path)
    if problems:
        return problems
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: {value!r} not one of {schema['enum']}"]
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        return [f"{path}: shorter than {schema['minLength']}"]
    if isinstance(value, dict):
        return _object_problems(value, schema, path)
    if isinstance(value, list) and "items" in schema:
        return [p for i, item in enumerate(value) for p in validate(item, schema["items"], f"{path}[{i}]")]
    return []


def _type_problems(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    python_types = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
    expected = schema.get("type")
    if expected is None:
        return []
    wrong = not isinstance(value, python_types[expected]) or (expected == "integer" and isinstance(value, bool))
    return [f"{path}: {value!r} is not of type {expected}"] if wrong else []


def _object_problems(value: dict, schema: dict[str, Any], path: str) -> list[str]:
    properties = schema.get("properties")
    extra = schema.get("additionalProperties")
    problems = [f"{path}.{key}: required" for key in schema.get("required", []) if key not in value]
    for key, item in value.items():
        if properties is not None and key in properties:
            problems += validate(item, properties[key], f"{path}.{key}")
        elif isinstance(extra, dict):
            problems += validate(item, extra, f"{path}.{key}")
        elif properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
            problems.append(f"{path}.{key}: unknown field")
    return problems
