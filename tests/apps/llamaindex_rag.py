"""A LlamaIndex RAG app traced by OpenInference's LlamaIndex instrumentor, as Arize Phoenix users set it up."""

from common import arguments, corpus, embed, run, tracer_provider
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.llms import MockLLM
from openinference.instrumentation.llama_index import LlamaIndexInstrumentor


class BagOfWords(BaseEmbedding):
    def _get_query_embedding(self, query: str) -> list[float]:
        return embed(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return embed(text)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return embed(query)


args = arguments()
provider, roots = tracer_provider(args)
LlamaIndexInstrumentor().instrument(tracer_provider=provider)
Settings.llm = MockLLM()  # no max_tokens: it answers with its prompt, so the answer shows the retrieved context
Settings.embed_model = BagOfWords()
index = VectorStoreIndex.from_documents([Document(text=text, id_=key) for key, text in corpus(args.edited).items()])
engine = index.as_query_engine(similarity_top_k=2)
run(args, provider, roots, lambda query: str(engine.query(query)))
