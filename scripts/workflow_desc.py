"""The description of an example workflow (:class:`WorkflowDesc`: nodes, widget values by input name, links
as ``node.out(slot)``, the files it expects), written by ``scripts/workflow_graphs.py`` and built by
``scripts/workflows.py``."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["FileDecl", "NodeDesc", "Out", "WorkflowDesc"]


@dataclasses.dataclass(frozen=True)
class Out:
    """Output ``slot`` of node ``node`` (a link source in a description)."""

    node: int
    slot: int = 0


@dataclasses.dataclass
class NodeDesc:
    id: int
    type: str
    values: dict[str, Any]
    title: str | None = None
    control: str = "fixed"

    def out(self, slot: int = 0) -> Out:
        return Out(self.id, slot)


@dataclasses.dataclass(frozen=True)
class FileDecl:
    """A file a workflow expects on the host."""

    name: str
    """As the widget shows it (the bf16 Loader's ``folder/name`` is split: name without the folder)."""
    directory: str
    """ComfyUI folder: ``models/<directory>/``, or ``input`` for ComfyUI's input folder."""
    url: str | None = None
    how: str = ""


@dataclasses.dataclass
class WorkflowDesc:
    name: str
    """Slug: the API twin ``workflows/api/<name>.json`` and the workflow's README entry."""
    title: str
    summary: str
    template: str = ""
    """The template card's title, which is the UI file's name (``workflows/<template>.json`` and ``.jpg``):
    both supported frontends show a custom-node template under its file name (``scripts.workflows.TEMPLATE_NAME``)."""
    cpu: bool = False
    files: list[FileDecl] = dataclasses.field(default_factory=list)
    packs: list[str] = dataclasses.field(default_factory=list)
    notes: str = ""
    nodes: list[NodeDesc] = dataclasses.field(default_factory=list)

    @property
    def template_name(self) -> str:
        return self.template or self.name

    def add(self, node_type: str, title: str | None = None, control: str = "fixed", **values: Any) -> NodeDesc:
        node = NodeDesc(id=len(self.nodes) + 1, type=node_type, values=values, title=title, control=control)
        self.nodes.append(node)
        return node
