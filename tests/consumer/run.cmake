# The `consumer` test (cmake -P): installs this build into a fresh prefix, then builds and runs
# tests/consumer against it through find_package(flexattn) and through pkg-config (when
# pkg-config is there), and against flexattn's source tree through add_subdirectory. Variables: BUILD_DIR, SOURCE_DIR, WORK_DIR, CXX_COMPILER, GENERATOR and
# CXX_FLAGS (the build's own, e.g. the sanitizers an instrumented library needs at link time).
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE output
                  ERROR_VARIABLE output)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "consumer: ${what} failed (${status}):\n${output}")
  endif()
  message(STATUS "consumer: ${what}: ok ${output}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run_step("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
foreach(required include/flexattn/flexattn.hpp include/flexattn/version.hpp bin/flexattn)
  if(NOT EXISTS ${prefix}/${required})
    message(FATAL_ERROR "consumer: the install has no ${required}")
  endif()
endforeach()
file(GLOB_RECURSE internal_headers ${prefix}/include/*/engines/* ${prefix}/include/core/*)
if(internal_headers)
  message(FATAL_ERROR "consumer: internal headers installed: ${internal_headers}")
endif()

run_step("configure with find_package" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer
         -B ${WORK_DIR}/build -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
         -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}")
run_step("build with find_package" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run_step("run (find_package)" ${WORK_DIR}/build/consumer)

# The library is compiled once more here (CPU engines only); ccache, when there, shares objects.
find_program(CCACHE ccache)
set(launcher "")
if(CCACHE)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE})
endif()
run_step("configure as a subproject" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer/subproject
         -B ${WORK_DIR}/subproject -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
         -DFLEXATTN_SOURCE_DIR=${SOURCE_DIR} -DCMAKE_BUILD_TYPE=Release
         "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" -DFLEXATTN_ENABLE_CUDA=OFF ${launcher})
run_step("build as a subproject" ${CMAKE_COMMAND} --build ${WORK_DIR}/subproject --target consumer)
run_step("run (subproject)" ${WORK_DIR}/subproject/consumer)

find_program(PKG_CONFIG pkg-config)
if(PKG_CONFIG)
  file(GLOB pc_dir LIST_DIRECTORIES true ${prefix}/lib*/pkgconfig)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${pc_dir}
                          ${PKG_CONFIG} --cflags --libs --static flexattn
                  RESULT_VARIABLE status OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "consumer: pkg-config does not know flexattn")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  separate_arguments(build_flags UNIX_COMMAND "${CXX_FLAGS}")
  run_step("build with pkg-config" ${CXX_COMPILER} -O1 ${build_flags}
           ${SOURCE_DIR}/tests/consumer/consumer.cpp
           -o ${WORK_DIR}/consumer_pkgconfig ${flags})
  run_step("run (pkg-config)" ${WORK_DIR}/consumer_pkgconfig)
endif()
