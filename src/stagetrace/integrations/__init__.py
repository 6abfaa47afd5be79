"""In-process hooks into the frameworks a pipeline runs on, one module per framework (``pytorch``), each imported
only by an application that uses that framework: importing ``stagetrace`` never imports them."""
