"""Search-augmented QA: question sets, retrievers (tantivy BM25, Elasticsearch, dense, HTTP server), the env.

Backends are imported on demand by :func:`~.backends.build_retriever`, so importing this package needs neither a
server nor the optional dense-retrieval extra.
"""

from megatron_gigpo.envs.search_qa.answers import exact_match, exact_match_reward, normalize_answer
from megatron_gigpo.envs.search_qa.backends import BACKENDS, build_retriever, shared_retriever
from megatron_gigpo.envs.search_qa.datasets import QARecord, load_tasks, read_qa_file
from megatron_gigpo.envs.search_qa.env import SearchQAEnv, extract_action, project_search_action
from megatron_gigpo.envs.search_qa.passages import Passage, format_information, read_passages
from megatron_gigpo.envs.search_qa.recipe import RECIPE, SearchConfig
from megatron_gigpo.envs.search_qa.retriever import Retriever, RetrieverUnavailableError

__all__ = [
    "BACKENDS",
    "Passage",
    "QARecord",
    "RECIPE",
    "SearchConfig",
    "Retriever",
    "RetrieverUnavailableError",
    "SearchQAEnv",
    "build_retriever",
    "shared_retriever",
    "exact_match",
    "exact_match_reward",
    "extract_action",
    "format_information",
    "load_tasks",
    "normalize_answer",
    "project_search_action",
    "read_passages",
    "read_qa_file",
]
