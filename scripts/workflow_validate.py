"""Validating a UI workflow and its API twin against the node schemas (:mod:`scripts.workflow_schema`):
every node type exists on the host, is frontend-only, or belongs to a declared pack the workflow names;
every link joins an existing output to an input of a compatible type (pass-through outputs resolved);
every widget value has the declared type and lies in the declared range or options; file-list COMBOs
(model files) are either on the host or declared with their folder; and the UI converted to API format
(:func:`..workflow_schema.ui_to_api`) equals the committed twin. :func:`validate_workflow` is the entry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from scripts.workflow_schema import (
    DECLARATIONS_PATH,
    DYNAMIC_COMBO,
    SHARED_OUTPUTS,
    InputSpec,
    NodeSchema,
    Schemas,
    effective_type,
    types_compatible,
    ui_to_api,
    value_counts,
)


def _fmt(workflow: str, node_id: Any, node_type: str, what: str) -> str:
    return f"{workflow}: node {node_id} ({node_type}): {what}"


def check_widget_value(spec: InputSpec, value: Any) -> str | None:
    """Why ``value`` is not a valid value of widget ``spec`` (None when it is)."""
    if spec.type == "INT":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"value {value!r} is not an INT"
    elif spec.type == "FLOAT":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"value {value!r} is not a FLOAT"
    elif spec.type == "BOOLEAN":
        if not isinstance(value, bool):
            return f"value {value!r} is not a BOOLEAN"
    elif spec.type == "STRING":
        if not isinstance(value, str):
            return f"value {value!r} is not a STRING"
    elif spec.type in ("COMBO", DYNAMIC_COMBO):
        if value not in (spec.options or ()):
            shown = list(spec.options or ())
            shown = shown[:8] + ["..."] if len(shown) > 8 else shown
            return f"value {value!r} is not one of the options {shown}"
    if spec.type in ("INT", "FLOAT"):
        lo, hi = spec.opts.get("min"), spec.opts.get("max")
        if lo is not None and value < lo:
            return f"value {value!r} is below the minimum {lo}"
        if hi is not None and value > hi:
            return f"value {value!r} is above the maximum {hi}"
        step = spec.opts.get("step")
        if spec.type == "INT" and isinstance(step, int) and step > 1:
            base = lo if isinstance(lo, int) else 0
            if (value - base) % step and value % step:
                return f"value {value!r} is not on the step {step} (from {base})"
    return None


@dataclasses.dataclass
class ValidationContext:
    workflow: str
    schemas: Schemas
    files: list[dict]
    """extra.vramfit.files of the UI workflow."""
    note_text: str
    cpu: bool
    packs: list[str]


def _check_file_value(ctx: ValidationContext, node_id: Any, node_type: str, spec: InputSpec, value: Any) -> str | None:
    rule = ctx.schemas.file_input(node_type, spec.name)
    if rule is None or value in (spec.options or ()):
        return None
    where = f"input '{spec.name}'"
    if ctx.cpu:
        return _fmt(ctx.workflow, node_id, node_type, f"{where}: file {value!r} is not on the host (CPU variant)")
    if not isinstance(value, str):
        return _fmt(ctx.workflow, node_id, node_type, f"{where}: value {value!r} is not a file name")
    folder, name = rule["folder"], value
    if folder == "*":
        folder, _, name = value.partition("/")
        if folder not in rule["folders"] or not name:
            return _fmt(ctx.workflow, node_id, node_type, f"{where}: value {value!r} is not 'folder/file' "
                        f"with a folder of {rule['folders']}")  # fmt: skip
    if not name.lower().endswith(tuple(rule["extensions"])):
        return _fmt(ctx.workflow, node_id, node_type, f"{where}: file {value!r} has none of the extensions "
                    f"{rule['extensions']}")  # fmt: skip
    declared = any(f["name"] == name and f["directory"] == folder for f in ctx.files)
    if not declared:
        return _fmt(ctx.workflow, node_id, node_type, f"{where}: file {value!r} is neither on the host nor "
                    f"declared in the workflow's files with directory {folder!r}")  # fmt: skip
    if f"`{name}`" not in ctx.note_text or f"/{folder}/" not in ctx.note_text:
        return _fmt(ctx.workflow, node_id, node_type, f"{where}: the note does not name file {name!r} and "
                    f"folder {folder!r}")  # fmt: skip
    return None


def _check_node_type(ctx: ValidationContext, node_id: Any, node_type: str) -> tuple[NodeSchema | None, list[str]]:
    schema = ctx.schemas.get(node_type)
    if schema is None:
        return None, [_fmt(ctx.workflow, node_id, node_type, f"node type {node_type!r} is not on the host "
                           "(/object_info) and not declared as a third-party node")]  # fmt: skip
    if schema.pack and schema.pack not in ctx.packs:
        return schema, [_fmt(ctx.workflow, node_id, node_type, f"node type {node_type!r} belongs to the "
                             f"third-party pack {schema.pack!r}, which the workflow does not declare")]  # fmt: skip
    if schema.pack and ctx.schemas.packs[schema.pack]["url"] not in ctx.note_text:
        return schema, [_fmt(ctx.workflow, node_id, node_type, f"the note does not name pack {schema.pack!r} "
                             f"({ctx.schemas.packs[schema.pack]['url']})")]  # fmt: skip
    return schema, []


def _check_widget(ctx: ValidationContext, node_id: Any, node_type: str, spec: InputSpec, value: Any) -> list[str]:
    if ctx.schemas.file_input(node_type, spec.name) is not None and value not in (spec.options or ()):
        err = _check_file_value(ctx, node_id, node_type, spec, value)
        return [err] if err else []
    why = check_widget_value(spec, value)
    return [_fmt(ctx.workflow, node_id, node_type, f"input '{spec.name}': {why}")] if why else []


def validate_ui(ctx: ValidationContext, ui: dict) -> list[str]:
    errors: list[str] = []
    wf, schemas = ctx.workflow, ctx.schemas
    nodes = {n["id"]: n for n in ui.get("nodes", [])}
    if len(nodes) != len(ui.get("nodes", [])):
        errors.append(f"{wf}: duplicate node ids")
    node_types = {nid: n["type"] for nid, n in nodes.items()}
    links = {}
    for link in ui.get("links", []):
        if not (isinstance(link, list) and len(link) == 6):
            errors.append(f"{wf}: malformed link {link!r}")
            continue
        links[link[0]] = link
    if ui.get("last_link_id", 0) < max(links, default=0) or ui.get("last_node_id", 0) < max(nodes, default=0):
        errors.append(f"{wf}: last_node_id/last_link_id below the ids in use")
    links_in = {}
    for link in links.values():
        dst = nodes.get(link[3])
        if dst and link[4] < len(dst.get("inputs", [])):
            links_in[(link[3], dst["inputs"][link[4]]["name"])] = (link[1], link[2])

    schemas_by_id: dict[Any, NodeSchema] = {}
    for nid, node in nodes.items():
        ntype = node["type"]
        if ntype in schemas.frontend_only:
            continue
        schema, errs = _check_node_type(ctx, nid, ntype)
        errors += errs
        if schema is None:
            continue
        schemas_by_id[nid] = schema
        linked = set()
        for slot, entry in enumerate(node.get("inputs", [])):
            spec = schema.input(entry.get("name"))
            if spec is None:
                errors.append(_fmt(wf, nid, ntype, f"input '{entry.get('name')}' is not an input of {ntype}"))
                continue
            if entry.get("type") != spec.type:
                errors.append(_fmt(wf, nid, ntype, f"input '{spec.name}': slot type {entry.get('type')!r} "
                                   f"is not the declared {spec.type!r}"))  # fmt: skip
            link_id = entry.get("link")
            if link_id is None:
                continue
            link = links.get(link_id)
            if link is None or link[3] != nid or link[4] != slot:
                errors.append(_fmt(wf, nid, ntype, f"input '{spec.name}': link {link_id} does not end here"))
                continue
            linked.add(spec.name)
        for spec in schema.sockets:
            if spec.required and spec.name not in linked:
                errors.append(_fmt(wf, nid, ntype, f"required input '{spec.name}' ({spec.type}) is not linked"))
        values = list(node.get("widgets_values") or [])
        slots = schemas.ui_widget_layout(schema, values)
        counts = value_counts(slots)
        if len(values) not in counts:
            shorter = f" (or {', '.join(map(str, counts[:-1]))} without trailing optional widgets)" if len(counts) > 1 else ""
            errors.append(_fmt(wf, nid, ntype, f"widgets_values has {len(values)} values, the node's widgets "
                               f"take {counts[-1]}{shorter}"))  # fmt: skip
            continue
        for slot in (s for s in slots if s.index < len(values)):
            spec = slot.spec
            if spec.name not in linked:
                errors += _check_widget(ctx, nid, ntype, spec, values[slot.index])
            if slot.control and values[slot.index + 1] not in schemas.control_values:
                errors.append(_fmt(wf, nid, ntype, f"input '{spec.name}': control_after_generate value "
                                   f"{values[slot.index + 1]!r} is not one of {sorted(schemas.control_values)}"))  # fmt: skip
        listed = [(o.get("name"), o.get("type")) for o in node.get("outputs", [])]
        declared = list(zip(schema.output_names, schema.outputs, strict=True))
        prefix_ok = schema.host_output_node or schema.type in SHARED_OUTPUTS  # outputs every host has
        if listed != declared and not (prefix_ok and listed == declared[: len(listed)]):
            errors.append(_fmt(wf, nid, ntype, f"outputs {listed} are not the declared {declared}"))

    for link_id, (_, src, src_slot, dst, dst_slot, ltype) in links.items():
        if src not in nodes or dst not in nodes:
            errors.append(f"{wf}: link {link_id} joins missing node {src if src not in nodes else dst}")
            continue
        if src not in schemas_by_id or dst not in schemas_by_id:
            continue
        src_schema, dst_node = schemas_by_id[src], nodes[dst]
        if src_slot >= len(src_schema.outputs):
            errors.append(_fmt(wf, src, src_schema.type, f"link {link_id} starts at missing output {src_slot}"))
            continue
        listed = nodes[src].get("outputs") or []
        if src_slot >= len(listed):
            errors.append(_fmt(wf, src, src_schema.type, f"link {link_id} starts at output {src_slot}, which the "
                               "node does not list"))  # fmt: skip
        elif link_id not in (listed[src_slot].get("links") or []):
            errors.append(_fmt(wf, src, src_schema.type, f"output {src_slot} does not list link {link_id}"))
        if dst_slot >= len(dst_node.get("inputs", [])):
            errors.append(_fmt(wf, dst, dst_node["type"], f"link {link_id} ends at missing input slot {dst_slot}"))
            continue
        spec = schemas_by_id[dst].input(dst_node["inputs"][dst_slot]["name"])
        if spec is None:
            continue
        src_type = effective_type(schemas, node_types, links_in, src, src_slot)
        if not types_compatible(src_type, spec.type):
            errors.append(_fmt(wf, dst, dst_node["type"], f"input '{spec.name}' ({spec.type}) is linked to "
                               f"output {src_slot} of node {src} ({src_schema.type}), of type {src_type!r}"))  # fmt: skip
        expected = spec.type if spec.type != "*" else src_type
        if ltype != expected:
            errors.append(_fmt(wf, dst, dst_node["type"], f"input '{spec.name}': link {link_id} records type "
                               f"{ltype!r}, expected {expected!r}"))  # fmt: skip
    return errors


def _check_api_inputs(ctx: ValidationContext, api: dict, node_types: dict, links_in: dict, nid: str,
                      schema: NodeSchema) -> list[str]:  # fmt: skip
    """Problems of one API node's inputs; a dynamic combo's value brings in the inputs of its option,
    found under their own key (``format.codec``) or the one every host accepts (``codec``)."""
    errors: list[str] = []
    inputs, ntype, seen = api[nid].get("inputs", {}), schema.type, set()

    def check(spec: InputSpec) -> None:
        key = spec.name if spec.name in inputs else schema.api_name(spec.name)
        if key in seen:
            return
        seen.add(key)
        if key not in inputs:
            if spec.required:
                errors.append(_fmt(ctx.workflow, nid, ntype, f"required input '{spec.name}' is missing"))
            return
        value = inputs[key]
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
            src = int(value[0])
            if value[0] not in api:
                errors.append(_fmt(ctx.workflow, nid, ntype, f"input '{spec.name}' links to missing node {src}"))
                return
            src_type = effective_type(ctx.schemas, node_types, links_in, src, value[1])
            if not types_compatible(src_type, spec.type):
                errors.append(_fmt(ctx.workflow, nid, ntype, f"input '{spec.name}' ({spec.type}) is linked to "
                                   f"output {value[1]} of node {src} ({node_types[src]}), of type {src_type!r}"))  # fmt: skip
        elif not spec.widget:
            errors.append(_fmt(ctx.workflow, nid, ntype, f"input '{spec.name}' ({spec.type}) needs a link, got {value!r}"))
        else:
            errors.extend(_check_widget(ctx, nid, ntype, spec, value))
            for nested in spec.option_inputs(value):
                check(nested)

    for spec in schema.inputs:
        check(spec)
    return errors


def validate_api(ctx: ValidationContext, api: dict) -> list[str]:
    """Check an API-format prompt the way ComfyUI's validation would, against the same schemas."""
    errors: list[str] = []
    wf = ctx.workflow
    node_types = {int(k): v.get("class_type", "?") for k, v in api.items()}
    links_in = {}
    for nid, node in api.items():
        for name, value in node.get("inputs", {}).items():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                links_in[(int(nid), name)] = (int(value[0]), value[1])
    for nid, node in api.items():
        ntype = node.get("class_type", "?")
        schema, errs = _check_node_type(ctx, nid, ntype)
        errors += [e.replace(f"{wf}:", f"{wf} (API):", 1) for e in errs]
        if schema is None:
            continue
        inputs = node.get("inputs", {})
        for name in inputs:
            if schema.input(name) is None:
                errors.append(_fmt(wf + " (API)", nid, ntype, f"input '{name}' is not an input of {ntype}"))
        errors += [e.replace(f"{wf}:", f"{wf} (API):", 1) for e in _check_api_inputs(ctx, api, node_types, links_in, nid, schema)]
    return errors


def note_text(ui: dict, schemas: Schemas) -> str:
    return "\n".join(
        str(v) for n in ui.get("nodes", []) if n["type"] in schemas.frontend_only for v in n.get("widgets_values", [])
    )


def validate_workflow(name: str, ui: dict, api: dict | None, schemas: Schemas) -> list[str]:
    """Every problem of a UI workflow and its API twin, as 'workflow: node id (type): what' lines."""
    meta = (ui.get("extra") or {}).get("vramfit") or {}
    ctx = ValidationContext(
        workflow=name, schemas=schemas, files=meta.get("files", []), note_text=note_text(ui, schemas),
        cpu=bool(meta.get("cpu")), packs=[p["name"] for p in meta.get("custom_node_packs", [])],
    )  # fmt: skip
    for pack in ctx.packs:
        if pack not in schemas.packs:
            return [f"{name}: custom node pack {pack!r} is not declared in {DECLARATIONS_PATH.name}"]
    errors = validate_ui(ctx, ui)
    if api is not None:
        errors += validate_api(ctx, api)
        if not errors:
            converted = ui_to_api(ui, schemas)
            if converted != api:
                for nid in sorted(set(converted) | set(api), key=int):
                    if converted.get(nid) != api.get(nid):
                        errors.append(f"{name}: node {nid}: the API twin {api.get(nid)!r} differs from the UI "
                                      f"workflow converted to API format {converted.get(nid)!r}")  # fmt: skip
    return errors
