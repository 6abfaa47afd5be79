"""A LangChain (LCEL) RAG chain traced by OpenLLMetry's LangChain instrumentation (opentelemetry-instrumentation-langchain)."""

from common import arguments, corpus, embed, run, tracer_provider
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.language_models.llms import LLM
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from opentelemetry.instrumentation.langchain import LangchainInstrumentor


class BagOfWords(Embeddings):
    def embed_documents(self, texts):
        return [embed(t) for t in texts]

    def embed_query(self, text):
        return embed(text)


class EchoLLM(LLM):
    """Stands in for a model: answers with the prompt it was given."""

    @property
    def _llm_type(self) -> str:
        return "echo"

    def _call(self, prompt, stop=None, run_manager=None, **kwargs) -> str:
        return prompt


args = arguments()
provider, roots = tracer_provider(args)
LangchainInstrumentor().instrument(tracer_provider=provider)
vectors = InMemoryVectorStore(BagOfWords())
vectors.add_documents([Document(page_content=text, id=key) for key, text in corpus(args.edited).items()])
retriever = vectors.as_retriever(search_kwargs={"k": 2})
chain = (
    {"context": retriever | (lambda docs: "\n".join(d.page_content for d in docs)), "question": RunnablePassthrough()}
    | PromptTemplate.from_template("Answer from the context.\n{context}\nQuestion: {question}")
    | EchoLLM()
    | StrOutputParser()
)
run(args, provider, roots, chain.invoke)
