"""A Haystack RAG pipeline (in-memory BM25 store, prompt builder, generator) traced by OpenInference's instrumentor."""

from common import arguments, corpus, run, tracer_provider
from openinference.instrumentation.haystack import HaystackInstrumentor

args = arguments()
provider, roots = tracer_provider(args)
HaystackInstrumentor().instrument(tracer_provider=provider)

from haystack import Document, Pipeline, component  # noqa: E402 - instrument before the pipeline is built
from haystack.components.builders import PromptBuilder  # noqa: E402
from haystack.components.retrievers.in_memory import InMemoryBM25Retriever  # noqa: E402
from haystack.document_stores.in_memory import InMemoryDocumentStore  # noqa: E402


@component
class EchoGenerator:
    """Stands in for a model: answers with the prompt it was given."""

    @component.output_types(replies=list[str])
    def run(self, prompt: str):
        return {"replies": [prompt]}


store = InMemoryDocumentStore()
store.write_documents([Document(id=key, content=text) for key, text in corpus(args.edited).items()])
pipeline = Pipeline()
pipeline.add_component("retriever", InMemoryBM25Retriever(document_store=store, top_k=2))
pipeline.add_component(
    "prompt_builder",
    PromptBuilder(
        template="Answer from the context.\n{% for d in documents %}{{ d.content }}\n{% endfor %}Question: {{ query }}",
        required_variables=["query", "documents"],
    ),
)
pipeline.add_component("llm", EchoGenerator())
pipeline.connect("retriever", "prompt_builder.documents")
pipeline.connect("prompt_builder", "llm")


def answer(query: str) -> str:
    return pipeline.run({"retriever": {"query": query}, "prompt_builder": {"query": query}})["llm"]["replies"][0]


run(args, provider, roots, answer)
