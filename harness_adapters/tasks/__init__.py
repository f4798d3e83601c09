"""Task sources: what an episode is asked to do, read from JSONL, a Harbor folder or a dataset.

A task knows nothing of where it runs, what runs it or how it is scored: it imports no other
room of harness_adapters.
"""

from harness_adapters.tasks.harbor import is_harbor, read_harbor
from harness_adapters.tasks.sources import load_tasks
from harness_adapters.tasks.task import HELD_OUT, HarborTask, Task, TaskError, task_from_row

__all__ = ["HELD_OUT", "HarborTask", "Task", "TaskError", "is_harbor", "load_tasks", "read_harbor", "task_from_row"]
